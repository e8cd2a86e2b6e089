"""Reading and writing Clover checkpoint directories (HF layout, safetensors only).

A checkpoint directory holds::

    config.json                      CloverConfig.save()
    model.safetensors                one file up to `max_shard_bytes` ...
    model-00001-of-0000N.safetensors ... or N shards plus
    model.safetensors.index.json     {"metadata": {"total_size": bytes}, "weight_map": {name: file}}
    generation_config.json           bos / eos / pad / mask ids, block_size, threshold
    tokenizer.json, tokenizer_config.json, ...   when a tokenizer is given

Writes are atomic: everything goes into a hidden sibling directory which is renamed onto the destination
only once complete, so an interrupted save leaves either the old checkpoint or the new one, never half of
one (`clover.atomic_files.atomic_directory`; the trainer writes its step directories through it too, `durable`:
fsynced). Tensors are streamed shard by shard, so a converter can write a checkpoint far larger than memory.

When `tie_word_embeddings` is set, `lm_head.weight` is the embedding matrix and is not stored.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from clover.atomic_files import atomic_directory
from clover.config import CloverConfig

logger = logging.getLogger(__name__)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
LM_HEAD = "lm_head.weight"
# Tokenizer files copied verbatim from a tokenizer directory (HF names; absent ones are skipped).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)


# -- what a model's checkpoint holds ---------------------------------------------------------------------
def checkpoint_tensor_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """Name -> shape of every tensor a checkpoint of `model` stores, in state-dict order.

    This is the model's state dict minus `lm_head.weight` when the embeddings are tied (the tied head is
    the embedding matrix, restored by the model itself). Works on a model built on the meta device.
    """
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    if _tied(model):
        shapes.pop(LM_HEAD, None)
    return shapes


def _tied(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "tie_word_embeddings", False))


# -- writing ---------------------------------------------------------------------------------------------
def save_checkpoint(model: torch.nn.Module, directory: str | Path, tokenizer_dir: str | Path | None = None,
                    *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, exclude: Collection[str] = (),
                    extra: Callable[[Path], None] | None = None) -> Path:
    """Save `model` (with a `.config: CloverConfig`) as a checkpoint directory, atomically.

    An existing checkpoint at `directory` is replaced as a whole. `exclude`: tensor names left out of the
    weights; `extra(tmp)` writes further files into the directory before it is published (an adapter).
    Returns the directory.
    """
    names = [n for n in checkpoint_tensor_shapes(model) if n not in exclude]
    state = model.state_dict()
    return write_checkpoint(directory, model.config, ((name, state[name]) for name in names),
                            tokenizer_dir=tokenizer_dir, max_shard_bytes=max_shard_bytes, overwrite=True,
                            extra=extra)


def write_checkpoint(directory: str | Path, config: CloverConfig,
                     tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *,
                     tokenizer_dir: str | Path | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                     overwrite: bool = False, extra: Callable[[Path], None] | None = None) -> Path:
    """Write a checkpoint from a stream of `(name, tensor)` pairs; the low-level half of `save_checkpoint`.

    Tensors are consumed lazily and flushed to a shard whenever the pending bytes would exceed
    `max_shard_bytes`, so peak memory is about one shard. With one shard the file is `model.safetensors`;
    with more, HF's `model-0000k-of-0000N.safetensors` names plus an index. `overwrite=False` refuses an
    existing `directory` (FileExistsError); `overwrite=True` replaces it, but only if it is empty or
    looks like a checkpoint (has a config.json), so a mistyped path never deletes unrelated files.
    """
    directory = Path(directory)
    if directory.exists():
        if not overwrite:
            raise FileExistsError(f"{directory} already exists; pass force/overwrite to replace it")
        if not directory.is_dir() or (any(directory.iterdir()) and not (directory / "config.json").exists()):
            raise FileExistsError(f"refusing to replace {directory}: it is not a checkpoint directory "
                                  "(no config.json) and not empty")
    with atomic_directory(directory) as tmp:
        write_checkpoint_files(tmp, config, tensors, tokenizer_dir=tokenizer_dir, max_shard_bytes=max_shard_bytes)
        if extra is not None:
            extra(tmp)
    return directory


def write_checkpoint_files(directory: Path, config: CloverConfig,
                           tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *,
                           tokenizer_dir: str | Path | None = None,
                           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """The files of a checkpoint, written into the existing directory `directory` (not atomically): the body of
    `write_checkpoint`, for a caller that publishes the directory with `atomic_directory` itself."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    config.save(directory)
    _write_generation_config(directory, config)
    _write_shards(directory, items, max_shard_bytes)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, directory)


def _write_generation_config(directory: Path, config: CloverConfig) -> None:
    data = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "mask_token_id": config.mask_token_id,
        "block_size": config.block_size,
        "threshold": config.threshold,
    }
    (directory / GENERATION_CONFIG).write_text(json.dumps(data, indent=2) + "\n")


def _write_shards(directory: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int) -> None:
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    shard_files: list[list[str]] = []  # names per shard, in order
    total = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        path = directory / f".shard-{len(shard_files):05d}.safetensors"
        save_file(pending, str(path), metadata={"format": "pt"})
        shard_files.append(list(pending))
        pending, pending_bytes = {}, 0

    seen_storage: set[int] = set()
    for name, tensor in tensors:
        if name in pending or any(name in names for names in shard_files):
            raise ValueError(f"tensor {name!r} written twice")
        t = tensor.detach().to("cpu").contiguous()
        size = t.numel() * t.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
            seen_storage.clear()
        # safetensors refuses tensors sharing memory within a file: store views and aliases as copies
        ptr = t.untyped_storage().data_ptr()
        if t.untyped_storage().nbytes() != size or ptr in seen_storage:
            t = t.clone()
        seen_storage.add(t.untyped_storage().data_ptr())
        pending[name] = t
        pending_bytes += size
        total += size
    flush()
    if not shard_files:
        raise ValueError("no tensors to write")

    if len(shard_files) == 1:
        os.replace(directory / ".shard-00000.safetensors", directory / SAFETENSORS_FILE)
        return
    n = len(shard_files)
    weight_map: dict[str, str] = {}
    for k, names in enumerate(shard_files):
        final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        os.replace(directory / f".shard-{k:05d}.safetensors", directory / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def copy_tokenizer_files(source: str | Path, destination: str | Path) -> list[str]:
    """Copy the HF tokenizer files present in `source` into `destination`; returns the names copied."""
    source, destination = Path(source), Path(destination)
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, destination / name)
            copied.append(name)
    if not copied:
        logger.warning("no tokenizer files found in %s", source)
    return copied


# -- reading ---------------------------------------------------------------------------------------------
def safetensors_files(directory: str | Path) -> dict[str, Path]:
    """Map each tensor name stored in `directory` to its safetensors file (index-aware)."""
    directory = Path(directory)
    index = directory / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / SAFETENSORS_FILE
    if single.exists():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {directory}")
    files: dict[str, Path] = {}
    for path in found:  # shards without an index
        with safe_open(str(path), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files


def load_state_dict_strict(model: torch.nn.Module, directory: str | Path) -> None:
    """Load the safetensors weights in `directory` into `model`, refusing any mismatch.

    Every tensor of `checkpoint_tensor_shapes(model)` must be stored with exactly its shape, and nothing
    else may be stored; otherwise ValueError naming each offending tensor (expected vs found shape). All
    names and shapes are checked before any weight is touched. Values are cast to the parameter's dtype
    and device. Parameters of a model built on the meta device are replaced by the loaded tensors (aliases
    such as a tied `lm_head` re-pointed); its non-persistent buffers are the caller's to materialise.
    """
    directory = Path(directory)
    files = safetensors_files(directory)
    expected = checkpoint_tensor_shapes(model)

    found: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if files.get(name) == path:
                    found[name] = tuple(f.get_slice(name).get_shape())

    problems = []
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected]
    if missing:
        problems.append(f"missing tensors: {format_names(missing)}")
    if unexpected:
        hint = " (tie_word_embeddings is set, so lm_head.weight must not be stored)" \
            if LM_HEAD in unexpected and _tied(model) else ""
        problems.append(f"unexpected tensors: {format_names(unexpected)}{hint}")
    for name, shape in expected.items():
        if name in found and tuple(shape) != found[name]:
            problems.append(f"tensor {name!r} has shape {list(found[name])}, expected {list(shape)}")
    if problems:
        raise ValueError(f"checkpoint {directory} does not fit the model: " + "; ".join(problems))

    state = model.state_dict(keep_vars=True)
    assigned: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    target = state[name]
                    value = f.get_tensor(name)
                    if target.is_meta:
                        assigned[name] = value.to(target.dtype)
                    else:
                        target.copy_(value)
    if assigned:
        # Meta parameters are replaced, which breaks aliasing (a tied head): re-point each alias afterwards.
        aliases = {alias: next(n for n in expected if state[n] is t)
                   for alias, t in state.items() if alias not in expected and any(state[n] is t for n in expected)}
        model.load_state_dict(assigned, strict=False, assign=True)
        for alias, name in aliases.items():
            owner, _, attr = alias.rpartition(".")
            source_owner, _, source_attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, getattr(model.get_submodule(source_owner), source_attr))


def format_names(names: list[str], limit: int = 8) -> str:
    """`'a', 'b', ... (N in all)`: tensor names for an error message, the first `limit` of them."""
    head = ", ".join(repr(n) for n in names[:limit])
    return head + (f", ... ({len(names)} in all)" if len(names) > limit else "")
