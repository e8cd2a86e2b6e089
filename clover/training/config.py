"""`TrainConfig`: every setting of a training run, in one dataclass (YAML file + `--key value` overrides).

    init: clover-tiny                 # a checkpoint directory, or a preset name (random init)
    train_data: data/train            # token shards (`clover data ...`), or chat/jsonl/text sources + data_kind
    block_size: 4
    lr: 3.0e-4
    noise: {weighting: inverse_rate}  # nested sections: noise.*, lora.*
    lora: {rank: 16}

`load_train_config(path, overrides)` reads the YAML, applies `["--lr", "1e-4", "--noise.t_min", "0.1"]`-style
overrides (values parsed as YAML scalars / lists), and checks every key and type: an unknown key, in the file or
on the command line, is an error that names it. The semantics of each field are in docs/training.md.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ConfigDict, TypeAdapter, ValidationError

from clover.model.lora import LoraConfig

NOISE_SCHEDULES = ("linear", "cosine")
NOISE_SAMPLING = ("bernoulli", "exact")
LOSS_WEIGHTING = ("none", "inverse_rate")
PAD_TARGETS = ("none", "eos")
PRECISIONS = ("fp32", "bf16", "auto")
PARALLEL = ("ddp", "fsdp")
DATA_KINDS = ("shards", "chat", "jsonl", "text")
RESUME = ("auto", "never")

# How pydantic reads the config dataclasses (`config_from_dict`): unknown keys are errors; numbers given for a
# string field (a YAML `tokenizer: 123`) are read as text.
PYDANTIC_CONFIG = ConfigDict(extra="forbid", coerce_numbers_to_str=True)


@dataclass
class NoiseConfig:
    """Masking of the noised copies (one mask rate per block)."""

    __pydantic_config__ = PYDANTIC_CONFIG

    schedule: str = "linear"  # rate r(t): "linear" r = t; "cosine" r = 1 - cos(pi t / 2)
    t_min: float = 1e-3  # t ~ U(t_min, t_max), one draw per block
    t_max: float = 1.0
    sampling: str = "bernoulli"  # "bernoulli": each position masked with prob r; "exact": ceil(r n) positions
    complementary: bool = True  # also train on the inverse mask (a second row per sample)
    weighting: str = "none"  # "none": mean CE over masked tokens; "inverse_rate": BD3 NELBO, CE / r per token
    full_mask_prob: float = 0.0  # fraction of blocks masked at every supervised position (what exact decoding sees)
    position_decay: float = 1.0  # weight decay^(p - 1) of the draft at block position p >= 1 (1: uniform)

    def validate(self) -> None:
        _choice("noise.schedule", self.schedule, NOISE_SCHEDULES)
        _choice("noise.sampling", self.sampling, NOISE_SAMPLING)
        _choice("noise.weighting", self.weighting, LOSS_WEIGHTING)
        if not 0.0 <= self.t_min < self.t_max <= 1.0:
            raise ValueError(f"noise: need 0 <= t_min < t_max <= 1, got t_min={self.t_min}, t_max={self.t_max}")
        if not 0.0 <= self.full_mask_prob <= 1.0:
            raise ValueError(f"noise.full_mask_prob must be in [0, 1], got {self.full_mask_prob}")
        if not 0.0 < self.position_decay <= 1.0:
            raise ValueError(f"noise.position_decay must be in (0, 1] (1: no decay), got {self.position_decay}")


@dataclass
class TrainConfig:
    __pydantic_config__ = PYDANTIC_CONFIG

    # -- model -------------------------------------------------------------------------------------------------
    init: str = "clover-tiny"  # checkpoint directory (from_pretrained) or preset name (random init)
    model_overrides: dict[str, Any] = field(default_factory=dict)  # CloverConfig fields, presets only
    # -- data --------------------------------------------------------------------------------------------------
    train_data: str = ""  # token-shard directory, or sources of `data_kind` (tokenized into output_dir/data)
    eval_data: str = ""  # held-out data, same kind; empty: no evaluation
    data_kind: str = "shards"  # "shards" | "chat" | "jsonl" | "text"
    tokenizer: str = ""  # for chat/jsonl/text sources (default: the init checkpoint directory)
    max_seq_len: int = 1024  # prompt + response tokens per document (longer responses are truncated)
    shuffle: bool = True  # reshuffle the documents every epoch (seeded)
    # -- objective ---------------------------------------------------------------------------------------------
    block_size: int = 4
    block_curriculum: list[list[int]] = field(default_factory=list)  # [[step, B], ...]: B from that step on
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    pad_target: str = "none"  # "none": [MASK] padding is never trained; "eos": pad the last block with EOS, trained
    ar_weight: float = 0.0  # + ar_weight * causal (block_size 1) next-token CE on the supervised tokens
    kl_weight: float = 0.0  # + kl_weight * KL(base || model) of the causal predictions (LoRA: base = adapters off)
    # + confidence_weight * entropy at masked positions already predicted right (CAP / certainty forcing)
    confidence_weight: float = 0.0
    ce_weight: float = 1.0  # weight of the diffusion cross-entropy (0 with draft_kl_weight > 0: pure distillation)
    # + draft_kl_weight * KL(base || model) at masked positions after a block's first, the base's distribution
    # read off the clean stream (needs causal context reading: a gated adapter)
    draft_kl_weight: float = 0.0
    # -- optimisation ------------------------------------------------------------------------------------------
    max_steps: int = 1000
    batch_size: int = 8  # documents per optimizer step, all ranks together
    micro_batch_size: int = 8  # documents per forward, per rank (gradient accumulation makes up the rest)
    lr: float = 1e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps
    warmup_steps: int = 100
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    precision: str = "bf16"  # "bf16": bf16 autocast with fp32 master weights; "fp32"; "auto": bf16 where the
    # hardware multiplies bf16 natively (a GPU, a CPU with AVX512-BF16 or AMX), else fp32 (`native_bf16`)
    gradient_checkpointing: bool = False
    seed: int = 0
    lora: LoraConfig = field(default_factory=LoraConfig)
    # -- distributed / device ----------------------------------------------------------------------------------
    parallel: str = "ddp"  # under torchrun (WORLD_SIZE > 1): "ddp" or "fsdp" (FSDP2 fully_shard per layer)
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda"
    threads: int = 0  # torch.set_num_threads on CPU; 0 leaves torch's default
    # -- output --------------------------------------------------------------------------------------------
    output_dir: str = "runs/clover"
    log_every: int = 1
    eval_every: int = 0  # steps between held-out evaluations (0: only at the end)
    eval_documents: int = 64  # documents of eval_data used (the first ones, fixed noise)
    save_every: int = 0  # steps between checkpoints (0: only at the end / when stopping)
    keep_checkpoints: int = 2  # newest complete checkpoints kept
    max_minutes: float = 0.0  # wall-clock budget: stop cleanly (with a checkpoint) after this many minutes
    # CPU budget of the whole run (every session, thread and rank: the `cpu_s` counter): stop cleanly before the
    # next step would cross it
    max_cpu_hours: float = 0.0
    resume: str = "auto"  # "auto": continue from output_dir's latest checkpoint; "never"; or a checkpoint dir
    progress: bool = True  # progress bar (rank 0)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        self.noise.validate()
        self.lora.validate()
        _choice("pad_target", self.pad_target, PAD_TARGETS)
        _choice("precision", self.precision, PRECISIONS)
        _choice("parallel", self.parallel, PARALLEL)
        _choice("data_kind", self.data_kind, DATA_KINDS)
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        for name in ("block_size", "max_steps", "batch_size", "micro_batch_size", "max_seq_len", "log_every",
                     "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "save_every", "eval_documents", "threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "weight_decay", "grad_clip", "ar_weight", "kl_weight", "confidence_weight", "max_minutes",
                     "max_cpu_hours", "min_lr_ratio", "ce_weight", "draft_kl_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.ce_weight == 0 and self.draft_kl_weight == 0:
            raise ValueError("ce_weight and draft_kl_weight are both 0: nothing trains the masked positions")
        if self.draft_kl_weight and not self.lora.gated:
            raise ValueError("draft_kl_weight needs lora.gated: true (the clean stream must be the frozen base, "
                             "read causally)")
        for entry in self.block_curriculum:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and all(isinstance(v, int) for v in entry)
                    and entry[0] >= 0 and entry[1] >= 1):
                raise ValueError(f"block_curriculum entries are [step, block_size] pairs of integers, got {entry!r}")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size "
                             f"({self.micro_batch_size}) times the number of processes")

    # -- derived -------------------------------------------------------------------------------------------
    def block_size_at(self, step: int) -> int:
        """Block size used at optimizer step `step` (0-based): the last curriculum entry at or before it."""
        size = self.block_size
        for start, b in sorted(self.block_curriculum):
            if step >= start:
                size = b
        return size

    def lr_at(self, step: int) -> float:
        """Learning rate at optimizer step `step` (0-based): linear warmup over `warmup_steps`, then cosine
        from `lr` to `lr * min_lr_ratio` at `max_steps`."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)

    @property
    def max_block_size(self) -> int:
        return max([self.block_size] + [b for _, b in self.block_curriculum])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name} must be one of {list(valid)}, got {value!r}")


# -- building from YAML / command line -------------------------------------------------------------------------
def config_keys(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """Every settable key, nested ones dotted (`noise.t_min`)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += config_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def config_from_dict(data: dict[str, Any], cls: type = TrainConfig) -> Any:
    """Build `cls` from a (nested) dict: pydantic checks every key and type, then the dataclasses' `validate`.

    Unknown keys and values of the wrong type are errors that name the (dotted) key."""
    try:
        return TypeAdapter(cls).validate_python(_shorthands(data, cls))
    except ValidationError as exc:
        raise _config_error(exc, cls) from None


def _shorthands(data: Any, cls: type) -> Any:
    """The two forms pydantic does not read itself: an empty YAML value for a string field (""), and a
    comma-separated string for a list field (`--lora.targets q_proj,v_proj` on the command line)."""
    if not isinstance(data, dict):
        return data
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in data.items():
        tp = hints.get(key)
        if dataclasses.is_dataclass(tp):
            value = _shorthands(value, tp)
        elif tp is str and value is None:
            value = ""
        elif typing.get_origin(tp) is list and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        out[key] = value
    return out


def _config_error(exc: ValidationError, cls: type) -> ValueError:
    """pydantic's errors as one message per key: `max_steps: input should be a valid integer, got 'many'`."""
    def key(loc: tuple[Any, ...]) -> str:
        return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "config"

    errors = exc.errors()
    unknown = [key(e["loc"]) for e in errors if e["type"] == "unexpected_keyword_argument"]
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        return ValueError(f"unknown config key{'s' if len(unknown) > 1 else ''} {names}; "
                          f"valid keys: {', '.join(config_keys(cls))}")
    messages = []
    for e in errors:
        if e["type"] == "value_error":  # raised by a `validate` method, whose message names the key itself
            messages.append(str(e["ctx"]["error"]))
        else:
            messages.append(f"{key(e['loc'])}: {e['msg'][:1].lower()}{e['msg'][1:]}, got {e['input']!r}")
    return ValueError("; ".join(messages))


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`["--lr", "1e-4", "--noise.t_min=0.1", "--progress", "false"]` -> nested dict (values parsed as YAML)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ValueError(f"expected --key value, got {arg!r}")
        key, eq, raw = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ValueError(f"--{key}: missing value")
            raw = args[i + 1]
            i += 1
        i += 1
        value = yaml.safe_load(raw) if raw.strip() else ""
        if isinstance(value, str) and raw.strip() and _looks_numeric(raw):
            value = float(raw)  # YAML 1.1 reads "1e-4" as a string
        parts = key.replace("-", "_").split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--{key}: {part} is not a section")
        node[parts[-1]] = value
    return out


def _looks_numeric(raw: str) -> bool:
    try:
        float(raw)
        return True
    except ValueError:
        return False


def merge_config(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`base` with `update`'s keys; nested sections merged key by key."""
    out = dict(base)
    for k, v in update.items():
        out[k] = merge_config(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_train_config(path: str | Path | None = None,
                      overrides: list[str] | dict[str, Any] | None = None) -> TrainConfig:
    """YAML file (optional) + overrides -> validated TrainConfig."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no training config at {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: invalid YAML ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    if overrides:
        update = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = merge_config(data, update)
    return config_from_dict(data)


def native_bf16(device_type: str) -> bool:
    """Whether `device_type` multiplies bf16 natively: CUDA, or a CPU that lists AVX512-BF16 or AMX-BF16. Without
    them bf16 matrix products are emulated, far slower than fp32 ones (on an AVX2-only EPYC, for one)."""
    if device_type != "cpu":
        return device_type == "cuda"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
