"""AR checkpoints served as they are named: converted once, on first use, into Clover's cache.

`clover generate / chat / serve / decide --model` take an HF checkpoint directory (a hub snapshot included) or a
GGUF file as well as a Clover checkpoint; `converted(src, key)` gives the Clover checkpoint of an AR source,
writing it the first time into `$CLOVER_CACHE/converted/<name>-<key>` (atomically: clover.checkpoint writes a
hidden sibling and renames it, so an interrupted conversion leaves nothing a later start would read) and returning
the cached one after. `key` names the source's content: a hub snapshot's commit (its files are content-addressed
blobs), else `fingerprint(src)`.

A model converted here is served as its AR base: exact mode (every answer the base's own greedy tokens, drafts
copied from the context and from the drafting memory, verified in one forward), committed tokens read causally, as
a GGUF conversion is (`clover.conversion.gguf`). `clover convert` keeps the block-diffusion defaults a training run
starts from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import re
from pathlib import Path

from clover.choices import SOURCE_FORMATS
from clover.conversion.common import run_conversion
from clover.conversion.families import FAMILIES
from clover.paths import cache_root

# config.json `model_type` -> `--from` format: the AR families first (a Qwen3.5 base's "qwen3_5" is itself, not the
# arcLM release that shares the name), then the released block-diffusion families' own types
AR_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                  "qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5",
                  "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe"}
MODEL_TYPES = {**{t: f.name for f in FAMILIES.values() for t in f.model_types}, **AR_MODEL_TYPES}
AR_BLOCK_SIZE = 4  # exact mode's first draft window; the engine sizes drafts to the machine's cost from there


def source_format(src: Path) -> str:
    """The `--from` format of an HF directory (its config.json `model_type`) or a GGUF file."""
    if src.is_file() and src.suffix == ".gguf":
        return "gguf"
    config = src / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{src}: no config.json (an HF checkpoint directory or a Clover checkpoint is "
                                "expected)")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{src}: config.json model_type {model_type!r} is not one Clover converts "
                         f"({', '.join(sorted(MODEL_TYPES))}; docs/conversion.md)")
    return MODEL_TYPES[model_type]


def fingerprint(src: Path) -> str:
    """A key for a local source's content, cheap enough for every start: the sha256 of every file's relative name,
    size and modification time (a rewritten file changes the key; the bytes of a 70 GB checkpoint are not read)."""
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        digest.update(f"{path.relative_to(src) if path != src else path.name}\0{stat.st_size}\0"
                      f"{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def converted(src: Path, key: str | None = None, name: str | None = None) -> Path:
    """The Clover checkpoint of AR source `src` (HF directory or GGUF file) whose content `key` names (None:
    `fingerprint(src)`), converted into the cache on first use (with a progress bar) and reused after. `name`: the
    cache entry's readable part (default: the source's name)."""
    key = key or fingerprint(src)
    label = re.sub(r"[^A-Za-z0-9._-]+", "--", name or (src.stem if src.is_file() else src.name)).strip("-")
    target = cache_root() / "converted" / f"{label}-{key}"
    if (target / "config.json").is_file():  # written whole or not at all
        return target
    fmt = source_format(src)
    module = importlib.import_module(f"clover.conversion.{SOURCE_FORMATS[fmt]}")
    with module.open_source(src, fmt) as source:
        if fmt not in FAMILIES:  # an AR base: served as itself (module docstring)
            source.config = dataclasses.replace(source.config, rule="exact", context_reading="causal",
                                                block_size=AR_BLOCK_SIZE)
        # force: a concurrent start that finished first is replaced by an identical checkpoint, atomically
        return run_conversion(source, target, force=True, progress=True)
