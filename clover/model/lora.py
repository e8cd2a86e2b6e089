"""Low-rank adapters, hand-written (no peft): `y = x W^T + b + (alpha / r) * dropout(x) A^T B^T`.

* `apply_lora(model, config)` freezes the model, replaces every `nn.Linear` whose name ends with one of
  `config.targets` by a `LoRALinear` (same `weight` / `bias` objects, so parameter names do not change), makes
  the selected embedding rows trainable through a small `row_delta` (the `[MASK]` row by default: a new token
  needs a learned embedding), and unfreezes the parameters named by `config.extra_trainable` (by default
  Clover's own block-diffusion parameters, `conv1d_right` and `memory_calibration`: small, zero at init).
* `adapter_state_dict(model)` is everything trainable (A, B, row deltas, extras): what an adapter checkpoint
  stores (`save_adapter` / `load_adapter`: `adapter.safetensors` + `adapter_config.json`).
* `merge_lora` / `unmerge_lora` fold the adapters into the weights and back; `merge_and_unload` folds them
  for good and restores plain modules, so `model.save_pretrained(dir)` writes an ordinary checkpoint.
* `adapters_disabled(model)` runs the base model (for the KL term against it).

**Gated adapters** (`config.gated`): the LoRA updates and the row deltas act only at *query* positions (masked
or drafted tokens); committed (clean) tokens are read by the unchanged base weights, so the model's causal path
is exactly the base model and its context is read causally (`apply_lora` sets `context_reading="causal"`). The
model's forward tells the shared `AdapterGate` where the query stream starts (every decoder layer re-opens it,
so gradient checkpointing's recomputation sees the right split). A gated adapter cannot be merged into the
weights: it is stored next to them (`save_pretrained` / `from_pretrained` keep it).

Routed experts are fused 3-D parameters, not `nn.Linear`: they are not LoRA targets (the shared expert is).
With tied embeddings the `row_delta` changes the input embedding only; merging writes it into the shared
matrix, so the tied LM head's row for that token (the `[MASK]` logit, never a target) moves with it.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

# Linear layers of the hybrid and dense families (attention, DeltaNet, shared expert / dense MLP).
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
                        "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    """Low-rank adapters (off when rank is 0)."""

    # as the training config reads it (pydantic's ConfigDict is a plain dict: no pydantic import to load a model)
    __pydantic_config__ = {"extra": "forbid", "coerce_numbers_to_str": True}

    rank: int = 0
    alpha: float = 16.0  # delta W = (alpha / rank) B A
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))  # nn.Linear names
    train_rows: list[str] = field(default_factory=lambda: ["mask"])  # embedding rows trained: ids or "mask"
    extra_trainable: list[str] = field(default_factory=lambda: ["conv1d_right", "memory_calibration"])
    # gated: adapters act only at query (masked / drafted) positions; committed context is read causally by the
    # unchanged base, so the causal path is the base model itself (and exact decoding reproduces it)
    gated: bool = False

    def validate(self) -> None:
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0, got {self.rank}")
        if self.rank and not self.targets:
            raise ValueError("lora.targets is empty: name the nn.Linear modules to adapt")
        for row in self.train_rows:
            if row != "mask" and not str(row).isdigit():
                raise ValueError(f"lora.train_rows: expected token ids or 'mask', got {row!r}")


logger = logging.getLogger(__name__)

ADAPTER_FILE = "adapter.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class AdapterGate:
    """Where a gated adapter acts: the forward's `[N, T]` token grid, adapted from position `start` on (the
    query stream). Set by the model's forward before each layer; read by the gated modules, whose inputs are
    `[N, T, F]` or flattened `[N * T, F]` (the MoE)."""

    def __init__(self) -> None:
        self.shape: tuple[int, int] | None = None
        self.start = 0

    def open(self, batch: int, tokens: int, start: int) -> None:
        self.shape, self.start = (batch, tokens), start

    def grid(self) -> tuple[int, int]:
        """`(tokens per sequence, first adapted position)`: the gate as the packed kernels take it
        (clover.ops.woq: rows of a flattened `[N, T]` grid are adapted where `row % T >= start`)."""
        if self.shape is None:
            raise RuntimeError("a gated adapter runs only inside a CloverForBlockDiffusion forward, which tells it "
                               "where the query tokens are")
        return self.shape[1], self.start

    def apply(self, base: torch.Tensor, x: torch.Tensor, delta: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`base` (the base module's output for input `x`) plus `delta(x)` at query positions only."""
        if self.shape is None:
            raise RuntimeError("a gated adapter runs only inside a CloverForBlockDiffusion forward, which tells it "
                               "where the query tokens are")
        n, t = self.shape
        if self.start >= t:  # no query tokens: the base model, untouched
            return base
        x3, y3 = x.reshape(n, t, x.shape[-1]), base.reshape(n, t, base.shape[-1])
        out = torch.cat([y3[:, : self.start], y3[:, self.start:] + delta(x3[:, self.start:])], dim=1)
        return out.reshape(base.shape)


class LoRALinear(nn.Linear):
    """An `nn.Linear` plus a low-rank update; `weight` and `bias` are the base layer's own parameters."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 gate: AdapterGate | None = None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.scaling = rank, alpha / rank
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **factory))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.merged = False
        self.enabled = True
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.merged:
            if not self.enabled:
                raise RuntimeError("cannot disable a merged LoRA adapter; unmerge it first")
            return y
        if not self.enabled:
            return y
        if self.gate is not None:
            return self.gate.apply(y, x, self._delta)
        return y + self._delta(x)

    def _delta(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """`scaling * B A`, in float64: rounded to the weight's dtype it does not depend on how many threads or
        which kernels summed the rank-r products, so merged weights (and their checksum) are reproducible."""
        return (self.lora_B.double() @ self.lora_A.double()) * self.scaling

    @torch.no_grad()
    def merge(self) -> None:
        _refuse_gated_merge(self.gate)
        if not self.merged:
            self.weight.add_(self.delta_weight().to(self.weight.dtype))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.weight.sub_(self.delta_weight().to(self.weight.dtype))
            self.merged = False

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, rank={self.rank}, scaling={self.scaling:g}"


class TrainableRowsEmbedding(nn.Embedding):
    """An `nn.Embedding` whose rows `rows` get a trainable additive `row_delta` (the base matrix stays frozen)."""

    def __init__(self, base: nn.Embedding, rows: list[int], gate: AdapterGate | None = None) -> None:
        nn.Module.__init__(self)
        for name in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                     "scale_grad_by_freq", "sparse"):
            setattr(self, name, getattr(base, name))
        self.weight = base.weight
        self.register_buffer("rows", torch.tensor(rows, dtype=torch.long, device=base.weight.device),
                             persistent=False)
        self.row_delta = nn.Parameter(torch.zeros(len(rows), self.embedding_dim, device=base.weight.device,
                                                  dtype=base.weight.dtype))
        self.merged = False
        self.enabled = True
        self.gate = gate

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        if self.merged or not self.enabled:
            return out
        if self.gate is not None:
            return self.gate.apply(out, ids[..., None], lambda query_ids: self._delta(query_ids[..., 0], out.dtype))
        return out + self._delta(ids, out.dtype)

    def _delta(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        hit = (ids[..., None] == self.rows).to(dtype)
        return hit @ self.row_delta.to(dtype)

    @torch.no_grad()
    def merge(self) -> None:
        _refuse_gated_merge(self.gate)
        if not self.merged:
            self.weight[self.rows] += self.row_delta.to(self.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.weight[self.rows] -= self.row_delta.to(self.weight.dtype)
            self.merged = False


def _refuse_gated_merge(gate: AdapterGate | None) -> None:
    if gate is not None:
        raise ValueError("a gated adapter acts only at query positions and cannot be merged into the weights "
                         "(the merged model would read committed context with the adapter too); keep it unmerged: "
                         "save_pretrained stores it next to the base weights and from_pretrained restores it")


def _adapted(model: nn.Module) -> Iterator[nn.Module]:
    for module in model.modules():
        if isinstance(module, (LoRALinear, TrainableRowsEmbedding)):
            yield module


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _matches(name: str, targets: list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def resolve_rows(model: nn.Module, rows: list[str]) -> list[int]:
    out = []
    for row in rows:
        if row == "mask":
            mask_id = getattr(getattr(model, "config", None), "mask_token_id", None)
            if mask_id is None:
                raise ValueError("lora.train_rows has 'mask' but the model has no mask_token_id")
            out.append(int(mask_id))
        else:
            out.append(int(row))
    return sorted(set(out))


def apply_lora(model: nn.Module, config: LoraConfig) -> dict[str, Any]:
    """Freeze `model` and add adapters in place (see module docstring). Returns what was adapted."""
    if config.rank < 1:
        raise ValueError("apply_lora needs lora.rank >= 1")
    if any(True for _ in _adapted(model)):
        raise ValueError("the model already has LoRA adapters")
    gate = None
    if config.gated:
        model_config = getattr(model, "config", None)
        if not hasattr(model, "adapter_gate") or model_config is None:
            raise ValueError("lora.gated needs a CloverForBlockDiffusion (its forward places the query stream)")
        extras = sorted(n for n, _ in model.named_parameters() if any(p in n for p in config.extra_trainable))
        if extras:
            raise ValueError(f"lora.gated: lora.extra_trainable matches base parameters {extras[:4]}..., which act "
                             "at every position (committed context too); set lora.extra_trainable: [] for a "
                             "gated adapter")
        gate = AdapterGate()
        model.adapter_gate = gate
        model_config.context_reading = "causal"  # the causal path is the base: committed tokens read causally
    model.lora_config = config  # what save_pretrained writes next to the weights
    model.requires_grad_(False)
    linear = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    chosen = [(n, m) for n, m in linear if _matches(n, config.targets)]
    if not chosen:
        names = sorted({n.rpartition(".")[2] for n, _ in linear})
        raise ValueError(f"lora.targets {config.targets} match no nn.Linear of the model; its linear layers are "
                         f"named {names}")
    for name, module in chosen:
        _set_child(model, name, LoRALinear(module, config.rank, config.alpha, config.dropout, gate))
    rows = resolve_rows(model, config.train_rows) if config.train_rows else []
    if rows:
        embed_name = next(n for n, m in model.named_modules() if type(m) is nn.Embedding)
        _set_child(model, embed_name, TrainableRowsEmbedding(model.get_submodule(embed_name), rows, gate))
    extras = []
    for name, param in model.named_parameters():
        if any(pattern in name for pattern in config.extra_trainable) and "lora_" not in name:
            param.requires_grad_(True)
            extras.append(name)
    for pattern in config.extra_trainable:
        if not any(pattern in n for n in extras):
            logger.info("lora.extra_trainable: %r matches no parameter of this model", pattern)
    for module in _adapted(model):
        for pname, param in module.named_parameters(recurse=False):
            if pname.startswith("lora_") or pname == "row_delta":
                param.requires_grad_(True)
    info = {"adapted": [n for n, _ in chosen], "rows": rows, "extra_trainable": extras,
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    logger.info("LoRA rank %d%s on %d linear layers, %d embedding rows, %d extra tensors: %d trainable parameters",
                config.rank, " (gated: query positions only)" if gate else "", len(chosen), len(rows), len(extras),
                info["trainable_parameters"])
    return info


def has_lora(model: nn.Module) -> bool:
    return any(True for _ in _adapted(model))


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable tensor (adapters, row deltas, extras), by parameter name."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def merge_lora(model: nn.Module) -> None:
    for module in _adapted(model):
        module.merge()


def unmerge_lora(model: nn.Module) -> None:
    for module in _adapted(model):
        module.unmerge()


def is_gated(model: nn.Module) -> bool:
    """Whether `model` carries a gated adapter (which acts at query positions only and cannot be merged)."""
    return getattr(model, "adapter_gate", None) is not None


def adapter_tensor_names(model: nn.Module) -> set[str]:
    """Names of the adapter's own tensors (LoRA factors, row deltas): not part of the base weights."""
    return {n for n, _ in model.named_parameters() if n.rpartition(".")[2] in ("lora_A", "lora_B", "row_delta")}


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weights and put plain `nn.Linear` / `nn.Embedding` modules back."""
    if is_gated(model):
        _refuse_gated_merge(model.adapter_gate)
    return _unload(model, merge=True)


def drop_adapter(model: nn.Module) -> nn.Module:
    """Put plain `nn.Linear` / `nn.Embedding` modules back without the adapter: the base model. For a gated adapter
    that is the model's causal path exactly (the adapter acts at query positions only)."""
    _unload(model, merge=False)
    model.adapter_gate = None
    return model


def _unload(model: nn.Module, merge: bool) -> nn.Module:
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            if merge:
                module.merge()
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device="meta")
            plain.weight, plain.bias = module.weight, module.bias
            _set_child(model, name, plain)
        elif isinstance(module, TrainableRowsEmbedding):
            if merge:
                module.merge()
            plain = nn.Embedding(module.num_embeddings, module.embedding_dim, module.padding_idx, device="meta")
            plain.weight = module.weight
            _set_child(model, name, plain)
    model.requires_grad_(True)
    return model


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model: every adapter (and row delta) switched off inside the block."""
    modules = list(_adapted(model))
    for module in modules:
        if module.merged:
            raise RuntimeError("adapters are merged; unmerge them before disabling")
        module.enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.enabled = True


def save_adapter(model: nn.Module, directory: str | Path, config: LoraConfig, base: str = "",
                 state: dict[str, torch.Tensor] | None = None) -> None:
    """Write `adapter.safetensors` (all trainable tensors) and `adapter_config.json` into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = state if state is not None else adapter_state_dict(model)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(directory / ADAPTER_FILE),
              metadata={"format": "pt"})
    meta = {"lora": {k: getattr(config, k) for k in ("rank", "alpha", "dropout", "targets", "train_rows",
                                                      "extra_trainable", "gated")},
            "base": base, "tensors": sorted(tensors)}
    (directory / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")


def read_adapter_config(directory: str | Path) -> tuple[LoraConfig, str]:
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"no LoRA adapter at {directory} ({ADAPTER_CONFIG} missing)")
    meta = json.loads(path.read_text())
    return LoraConfig(**meta["lora"]), meta.get("base", "")


def load_adapter(model: nn.Module, directory: str | Path, apply: bool | None = None) -> None:
    """Load an adapter written by `save_adapter` (applying LoRA first when the model has none)."""
    config, _ = read_adapter_config(directory)
    if apply or (apply is None and not has_lora(model)):
        apply_lora(model, config)
    tensors = load_file(str(Path(directory) / ADAPTER_FILE))
    expected = adapter_state_dict(model)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"adapter {directory} does not fit the model: missing {missing}, unexpected {unexpected}")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            if params[name].shape != value.shape:
                raise ValueError(f"adapter tensor {name!r} has shape {list(value.shape)}, "
                                 f"expected {list(params[name].shape)}")
            params[name].copy_(value)
