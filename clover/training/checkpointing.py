"""Training checkpoints: what a run saves, where, and how it resumes from it.

    output_dir/checkpoints/
        latest                       one line: the name of the newest complete checkpoint
        step-XXXXXXXX/               every `save_every` steps and at the end (`keep_checkpoints` newest kept)
            config.json, model.safetensors, ...   an ordinary Clover checkpoint (LoRA: `adapter.safetensors` +
                                                  `adapter_config.json` + config.json instead)
            trainer/optimizer.safetensors         every optimizer tensor, flattened as `param::exp_avg`
            trainer/optimizer.json                the optimizer's param groups and scalars
            trainer/rng-rankN.safetensors         the torch RNG state of each rank
            trainer/state.json                    step, tokens, data position, world size, the config

No pickle. A step directory is written through `clover.atomic_files.atomic_directory` (a hidden temporary
directory, fsynced, renamed into place) and only then is `latest` replaced (`atomic_write_text`): a failed save
(disk full, a crash) leaves `latest` on the previous complete checkpoint, and `remove_stale_temporaries` clears
what a killed one left at the next start. Resuming restores weights, optimizer, RNG and counters, so a killed and
resumed run has the same loss curve as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from clover.atomic_files import atomic_directory, atomic_write_text
from clover.checkpoint import TOKENIZER_FILES, load_state_dict_strict, write_checkpoint_files
from clover.model import CloverForBlockDiffusion
from clover.training.config import TrainConfig
from clover.training.distributed import DistInfo
from clover.model.lora import load_adapter, save_adapter

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TRAINER_DIR = "trainer"
STATE_VERSION = 2  # 2: seeds mixed by numpy's SeedSequence (version 1: splitmix64), so streams differ
# what `state.json` restores of the loop's progress; `cpu_s`: CPU seconds of training, all processes (a
# checkpoint written before it was counted restores 0)
COUNTERS = ("step", "tokens", "supervised_tokens", "cpu_s")
# What a save leaves under a temporary name when killed: the step directory being written and the one it
# replaces (`.step-….tmp-…`, `.step-….old-…`; before the trainer wrote through `atomic_directory`: `.tmp-step-…`,
# `.old-step-…`), and the `latest` pointer's file (`.latest.tmp-…`).
STALE_PATTERNS = (".tmp-*", ".old-*", ".*.tmp-*", ".*.old-*")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint `output_dir/checkpoints/latest` points to, or None."""
    root = Path(output_dir) / CHECKPOINTS
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / TRAINER_DIR / "state.json").is_file():
        raise FileNotFoundError(f"{pointer} points to {path}, which is not a complete checkpoint")
    return path


def remove_stale_temporaries(root: Path) -> list[Path]:
    """Delete every temporary a killed save left in `root` (files and directories); returns what was removed."""
    stale = sorted({path for pattern in STALE_PATTERNS for path in root.glob(pattern)})
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if stale:
        logger.info("removed %d temporaries left by an interrupted save: %s", len(stale),
                    ", ".join(p.name for p in stale))
    return stale


# -- optimizer state as safetensors + JSON ---------------------------------------------------------------------
def flatten_optimizer_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`get_optimizer_state_dict` output -> (tensors for safetensors, JSON for everything else)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, entry in state["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{fqn}::{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(fqn, {})[key] = value
    return tensors, {"scalars": scalars, "param_groups": state["param_groups"]}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for name, value in tensors.items():
        fqn, _, key = name.rpartition("::")
        state.setdefault(fqn, {})[key] = value
    for fqn, entries in meta["scalars"].items():
        state.setdefault(fqn, {}).update(entries)
    return {"state": state, "param_groups": meta["param_groups"]}


def _write_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path)) if tensors else save_file({"_empty": torch.zeros(0)}, str(path))


# -- saving ----------------------------------------------------------------------------------------------------
def save_training_checkpoint(root: Path, model: CloverForBlockDiffusion, optimizer: torch.optim.Optimizer,
                             counters: dict[str, int], config: TrainConfig, info: DistInfo) -> Path:
    """Write `root/step-XXXXXXXX` for `counters["step"]`, atomically; then point `root/latest` at it.

    Every rank calls it: the full model and optimizer state (FSDP2 shards included) and each rank's RNG state are
    gathered onto rank 0, which writes everything. A failure raises RuntimeError on every rank, with `latest`
    still on the previous complete checkpoint.
    """
    # deferred: torch.distributed.checkpoint's imports are slow, paid when a checkpoint is first written
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    lora = config.lora.rank > 0
    step = counters["step"]
    name = checkpoint_name(step)
    model_state = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora))
    optim_state = get_optimizer_state_dict(model, optimizer,
                                           options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["torch_cuda"] = torch.cuda.get_rng_state(info.device if info.device.type == "cuda" else None)
    rngs = info.gather(rng)
    error: Exception | None = None
    if info.rank == 0:
        try:
            with atomic_directory(root / name, durable=True) as tmp:
                _write_model(tmp, model, model_state, config)
                trainer_dir = tmp / TRAINER_DIR
                trainer_dir.mkdir()
                tensors, meta = flatten_optimizer_state(optim_state)
                _write_tensors(tensors, trainer_dir / "optimizer.safetensors")
                (trainer_dir / "optimizer.json").write_text(json.dumps(meta, indent=1) + "\n")
                for rank, state in enumerate(rngs):
                    save_file(state, str(trainer_dir / f"rng-rank{rank}.safetensors"))
                state = {"version": STATE_VERSION, **counters, "data_position": step * config.batch_size,
                         "world_size": info.world, "lora": lora, "config": config.to_dict(), "saved_at": time.time()}
                (trainer_dir / "state.json").write_text(json.dumps(state, indent=2) + "\n")
            atomic_write_text(root / LATEST, name + "\n", durable=True)
            prune_checkpoints(root, config.keep_checkpoints, keep=name)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = exc
    if info.broadcast(error is not None):
        raise RuntimeError(f"checkpoint at step {step} failed ({error!r}); "
                           f"{root / LATEST} still points to the previous complete checkpoint") from error
    return root / name


def _write_model(directory: Path, model: CloverForBlockDiffusion, model_state: dict[str, torch.Tensor],
                 config: TrainConfig) -> None:
    """The weights: a full Clover checkpoint, or with LoRA the trainable tensors as an adapter (frozen ones were
    left out of `model_state`) and the model's config.json."""
    mcfg = model.config
    if config.lora.rank == 0:
        tied = mcfg.tie_word_embeddings
        tensors = ((k, v) for k, v in model_state.items() if not (tied and k == "lm_head.weight"))
        write_checkpoint_files(directory, mcfg, tensors, tokenizer_dir=_tokenizer_dir(config))
        return
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    state = {k: v for k, v in model_state.items() if k in trainable}
    save_adapter(model, directory, config.lora, base=config.init, state=state)
    mcfg.save(directory)


def _tokenizer_dir(config: TrainConfig) -> Path | None:
    """Where the tokenizer files are (copied into full checkpoints so `clover generate` can use them)."""
    for candidate in (config.tokenizer, config.init):
        if candidate and Path(candidate).is_dir() and any((Path(candidate) / n).is_file() for n in TOKENIZER_FILES):
            return Path(candidate)
    return None


def prune_checkpoints(root: Path, keep_checkpoints: int, keep: str) -> None:
    """Delete all but the newest `keep_checkpoints` complete step directories (never the one named `keep`)."""
    done = sorted(p for p in root.glob("step-*") if (p / TRAINER_DIR / "state.json").is_file())
    for path in done[: max(len(done) - keep_checkpoints, 0)]:
        if path.name != keep:
            shutil.rmtree(path, ignore_errors=True)


# -- resuming --------------------------------------------------------------------------------------------------
def load_weights(model: nn.Module, path: Path, lora: bool) -> None:
    """The weights of checkpoint `path` into `model` (with LoRA: into its adapters, already applied)."""
    if lora:
        load_adapter(model, path, apply=False)
    else:
        load_state_dict_strict(model, path)


def load_training_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig,
                        info: DistInfo) -> dict[str, int]:
    """Restore the optimizer and this rank's RNG state from checkpoint `path`; returns its counters."""
    # deferred: torch.distributed.checkpoint's imports are slow, paid when a checkpoint is first read
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    lora = config.lora.rank > 0
    trainer_dir = path / TRAINER_DIR
    state = json.loads((trainer_dir / "state.json").read_text())
    if state.get("lora") != lora:
        raise ValueError(f"{path}: checkpoint lora={state.get('lora')} but this run has lora={lora}")
    if state.get("version", 1) != STATE_VERSION:
        logger.warning("%s: trainer state version %s, this trainer writes %s: the data order and noise masks "
                       "of the resumed run differ from an uninterrupted one", path, state.get("version", 1),
                       STATE_VERSION)
    old = state.get("config", {})
    for key in ("batch_size", "seed", "shuffle"):
        if key in old and old[key] != getattr(config, key):
            logger.warning("resuming with %s=%r (checkpoint: %r): the data order will differ",
                           key, getattr(config, key), old[key])
    tensors = load_file(str(trainer_dir / "optimizer.safetensors"))
    tensors.pop("_empty", None)
    meta = json.loads((trainer_dir / "optimizer.json").read_text())
    optim_state = unflatten_optimizer_state(tensors, meta)
    set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))
    rng_path = trainer_dir / f"rng-rank{info.rank}.safetensors"
    if not rng_path.is_file():
        rng_path = trainer_dir / "rng-rank0.safetensors"
    rng = load_file(str(rng_path))
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and info.device.type == "cuda":
        torch.cuda.set_rng_state(rng["torch_cuda"], info.device)
    return {k: state.get(k, 0) for k in COUNTERS}


# -- milestones ------------------------------------------------------------------------------------------------
MILESTONE_LOG = "train_log.jsonl"


def save_milestone(checkpoint: Path, dest: Path, log: Path | None = None) -> dict[str, Any]:
    """A compact copy of LoRA training checkpoint `checkpoint`, small enough to commit: the adapter as is (fp32),
    Adam's moments in bf16 (half their size; a run resumed from the milestone continues within their rounding),
    the RNG state and counters, and `log`'s records up to the checkpoint's step. Written atomically; returns
    the counters. `restore_milestone` turns it back into a checkpoint a run resumes from."""
    state = json.loads((checkpoint / TRAINER_DIR / "state.json").read_text())
    if not state.get("lora"):
        raise ValueError(f"{checkpoint}: a milestone keeps LoRA runs only (a full model is not compact)")
    with atomic_directory(dest, durable=True) as tmp:
        shutil.copytree(checkpoint, tmp, dirs_exist_ok=True)
        _cast_moments(tmp / TRAINER_DIR / "optimizer.safetensors", torch.bfloat16)
        if log is not None and log.is_file():
            kept = [line for line in log.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= state["step"]]
            (tmp / MILESTONE_LOG).write_text("".join(line + "\n" for line in kept))
    return {k: state.get(k, 0) for k in COUNTERS}


def restore_milestone(milestone: Path, output_dir: Path) -> int | None:
    """Make milestone `milestone` the checkpoint `output_dir` resumes from, unless `output_dir` already holds a
    checkpoint as new or newer. Returns the milestone's step when restored, else None."""
    state = json.loads((milestone / TRAINER_DIR / "state.json").read_text())
    current = latest_checkpoint(output_dir)
    if current is not None and json.loads((current / TRAINER_DIR / "state.json").read_text())["step"] >= state["step"]:
        return None
    root = Path(output_dir) / CHECKPOINTS
    name = checkpoint_name(state["step"])
    with atomic_directory(root / name, durable=True) as tmp:
        shutil.copytree(milestone, tmp, dirs_exist_ok=True)
        (tmp / MILESTONE_LOG).unlink(missing_ok=True)
        _cast_moments(tmp / TRAINER_DIR / "optimizer.safetensors", torch.float32)
    if (milestone / MILESTONE_LOG).is_file():
        atomic_write_text(Path(output_dir) / MILESTONE_LOG, (milestone / MILESTONE_LOG).read_text())
    atomic_write_text(root / LATEST, name + "\n", durable=True)
    return state["step"]


def _cast_moments(path: Path, dtype: torch.dtype) -> None:
    """Rewrite the optimizer's floating-point tensors (Adam's moments) of `path` in `dtype`."""
    tensors = load_file(str(path))
    save_file({k: v.to(dtype) if v.is_floating_point() and v.ndim else v for k, v in tensors.items()}, str(path))
