"""Loading a Clover checkpoint's tokenizer (written by `clover convert` next to the weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


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


END_OF_TURN = "<|im_end|>"  # the chat template's end of an assistant turn


def eos_token_ids(config: Any, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end generation, the same for every front end (CLI, chat, server): the model config's EOS,
    the tokenizer's EOS and the chat template's end of turn, where the vocabulary has them."""
    ids = set(config.eos_token_ids)
    vocab = tokenizer.get_vocab()
    for token in (tokenizer.eos_token, END_OF_TURN):
        if token and token in vocab:
            ids.add(vocab[token])
    return sorted(ids)
