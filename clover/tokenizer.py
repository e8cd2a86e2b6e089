"""Loading a Clover checkpoint's tokenizer (written by `clover convert` next to the weights)."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer stored in `directory` (tokenizer.json + tokenizer_config.json, chat template included).

    Raises FileNotFoundError when the directory has no tokenizer.json.
    """
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {directory}: a Clover checkpoint carries its tokenizer when converted from a "
            "source that has one (`clover convert`), or pass tokenizer_dir to save_pretrained")
    return PreTrainedTokenizerFast.from_pretrained(str(directory))
