"""What `--model` names, as users type it: a hub id, an HF checkpoint directory, a GGUF file or a Clover checkpoint.

    --model Qwen/Qwen3-0.6B            a hub id, `org/name[@revision]`: huggingface_hub's cache, downloaded when
                                        online (its progress bar); HF_HUB_OFFLINE=1: the cache only
    --model ~/models/Qwen3-0.6B         an HF checkpoint directory (config.json + safetensors)
    --model model.Q4_0.gguf             a GGUF file
    --model ~/ckpt                      a Clover checkpoint directory

`locate` finds the files; `checkpoint_for` gives a checkpoint runner its Clover checkpoint, converting an AR
source once into the cache (clover.conversion.cached); `--runner auto` picks the llama.cpp runner for a GGUF file,
the torch runner for the rest. Imports nothing heavy: huggingface_hub only for a hub id, torch only to convert.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
# what a checkpoint needs from a hub repository: its config, weights and tokenizer, not the other formats some
# repositories also carry (pytorch_model.bin, ONNX, GGUF quantisations)
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


@dataclass(frozen=True)
class ModelSource:
    path: Path  # a directory (Clover or HF checkpoint) or a GGUF file
    name: str  # what a server answers to: the hub id as typed, else the directory's or file's name
    key: str | None = None  # a hub snapshot's commit (its content's name); None: fingerprinted when converted

    @property
    def is_gguf(self) -> bool:
        return self.path.is_file() and self.path.suffix == ".gguf"


def locate(arg: str) -> ModelSource:
    """The files `--model arg` names: an existing path, else a hub id resolved through huggingface_hub."""
    path = Path(arg).expanduser()
    if path.exists():
        if path.is_file() and path.suffix != ".gguf":
            raise ValueError(f"--model {arg}: a file that is not a GGUF file (give a checkpoint directory, a .gguf "
                             "file or a hub id org/name)")
        return ModelSource(path, path.stem if path.is_file() else path.name)
    match = HUB_ID.fullmatch(arg)
    if match is None:
        raise FileNotFoundError(f"--model {arg}: no such file or directory, and not a hub id (org/name[@revision])")
    return hub_snapshot(arg, match["repo"], match["revision"])


def hub_snapshot(arg: str, repo: str, revision: str | None) -> ModelSource:
    """`repo` at `revision` (default: main) from huggingface_hub's cache (`HF_HOME` / `HF_HUB_CACHE`), downloaded
    first when online; offline (`HF_HUB_OFFLINE=1`, or the hub unreachable) the cache must hold it."""
    from huggingface_hub import constants, snapshot_download  # deferred: only a hub id needs it
    from huggingface_hub.errors import LocalEntryNotFoundError  # deferred: as above

    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError as e:
        where = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise FileNotFoundError(f"--model {arg}: not in the hub cache ({constants.HF_HUB_CACHE}) and {where}; "
                                f"download it once online (`hf download {repo}`), or give a local directory") from e
    return ModelSource(folder, arg, key=folder.name)  # snapshots/<commit>


def checkpoint_for(source: ModelSource) -> Path:
    """The Clover checkpoint a checkpoint runner opens: `source` itself, or its conversion (cached)."""
    if not source.is_gguf and is_clover_checkpoint(source.path):
        return source.path
    from clover.conversion.cached import converted  # deferred: converting imports torch and transformers

    return converted(source.path, source.key, name=source.name)


def is_clover_checkpoint(directory: Path) -> bool:
    config = directory / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "clover"
