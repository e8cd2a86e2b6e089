"""A Clover checkpoint's tokenizer (written by `clover convert` next to the weights), on the `tokenizers` library.

`Tokenizer` reads `tokenizer.json` (the Rust tokenizer) and `tokenizer_config.json` (special tokens, chat
template) and answers the part of `transformers`' tokenizer interface Clover uses — `tok(text)["input_ids"]`,
`decode`, `get_vocab`, `len(tok)`, the special tokens and `apply_chat_template` — with the same results
(tests/test_tokenizer.py holds it to `transformers`' `PreTrainedTokenizerFast` on the default model's tokenizer). It
exists for start-up time: importing `transformers` costs about a second on a small CPU, more than a short answer;
`tokenizers` and `jinja2` cost a tenth of that. Chat templates render in the environment `transformers` gives them
(a sandbox with `trim_blocks`, `lstrip_blocks`, loop controls, its `tojson`, `raise_exception` and `strftime_now`), so
a checkpoint's own template renders as it does there.
"""

from __future__ import annotations

import functools
import json
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import tokenizers

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_CLEAN_UP = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]  # where transformers keeps a template beside tokenizer_config.json


class Encoded(dict):
    """`{"input_ids": ...}`, also read as `.input_ids` (as `transformers`' `BatchEncoding` is)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    """A fast tokenizer and its special tokens; `name_or_path`: the directory it was read from."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict[str, Any], name_or_path: str = "") -> None:
        self.backend_tokenizer = backend
        self.config = config
        self.name_or_path = name_or_path
        self.chat_template: str | None = config.get("chat_template")
        self._vocab = backend.get_vocab(with_added_tokens=True)
        for name in SPECIAL_TOKENS:
            value = config.get(name)
            token = value.get("content") if isinstance(value, dict) else value
            if token is not None and token not in self._vocab:
                raise ValueError(f"{name_or_path or 'tokenizer'}: tokenizer_config.json names {name} {token!r}, "
                                 "which tokenizer.json does not have")
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else self._vocab[token])
        special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        self.all_special_ids = sorted({self._vocab[t] for t in special} |
                                      {getattr(self, f"{n}_id") for n in SPECIAL_TOKENS} - {None})

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        directory = Path(directory)
        config_path = directory / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_path}: not valid JSON ({exc})") from exc
        template = directory / CHAT_TEMPLATE_FILE
        if template.is_file():
            config["chat_template"] = template.read_text(encoding="utf-8")
        return cls(tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")), config, str(directory))

    def save(self, directory: str | Path) -> None:
        """Write `tokenizer.json`, `tokenizer_config.json` and the chat template (as `transformers` writes them)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.name_or_path and (Path(self.name_or_path) / "tokenizer.json").is_file():
            shutil.copyfile(Path(self.name_or_path) / "tokenizer.json", directory / "tokenizer.json")
        else:
            self.backend_tokenizer.save(str(directory / "tokenizer.json"))
        config = {k: v for k, v in self.config.items() if k != "chat_template"}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                         encoding="utf-8")
        if self.chat_template is not None:
            (directory / CHAT_TEMPLATE_FILE).write_text(self.chat_template, encoding="utf-8")

    # -- text <-> ids ----------------------------------------------------------------------------------------------
    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True, verbose: bool = True) -> Encoded:
        """`verbose`: `transformers`' switch for its long-input warning; this tokenizer has none to give."""
        if isinstance(text, str):
            return Encoded(input_ids=self.encode(text, add_special_tokens))
        return Encoded(input_ids=[e.ids for e in self.backend_tokenizer.encode_batch(list(text), add_special_tokens)])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.config.get("clean_up_tokenization_spaces"):  # transformers' clean-up of spaced punctuation
            for spaced, joined in _CLEAN_UP:
                text = text.replace(spaced, joined)
        return text

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Without added tokens, as `transformers` counts it (`len(tok)` counts them)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    # -- chat ------------------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int]:
        """The conversation rendered by `chat_template` (default: the tokenizer's own), with the special tokens
        and `kwargs` (e.g. `enable_thinking`) in scope, as `transformers` renders it; `tokenize`: its ids."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(f"{self.name_or_path or 'this tokenizer'} has no chat template")
        specials = {name: getattr(self, name) for name in SPECIAL_TOKENS if getattr(self, name) is not None}
        text = compile_template(template).render(messages=messages, tools=tools,
                                                 add_generation_prompt=add_generation_prompt, **specials, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """A chat template compiled in `transformers`' environment for templates (see the module docstring)."""
    # deferred: jinja2, only a chat prompt renders a template
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # jinja's own escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer stored in `directory` (tokenizer.json + tokenizer_config.json, chat template included).

    Raises FileNotFoundError when the directory has no tokenizer.json.
    """
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {directory}: a Clover checkpoint carries its tokenizer when converted from a "
            "source that has one (`clover convert`), or pass tokenizer_dir to save_pretrained")
    return Tokenizer.from_dir(directory)


END_OF_TURN = "<|im_end|>"  # the chat template's end of an assistant turn


def eos_token_ids(config: Any, tokenizer: Any) -> list[int]:
    """The ids that end generation, the same for every front end (CLI, chat, server): the model config's EOS,
    the tokenizer's EOS and the chat template's end of turn, where the vocabulary has them."""
    ids = set(config.eos_token_ids)
    vocab = tokenizer.get_vocab()
    for token in (tokenizer.eos_token, END_OF_TURN):
        if token and token in vocab:
            ids.add(vocab[token])
    return sorted(ids)
