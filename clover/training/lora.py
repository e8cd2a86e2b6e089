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

Routed experts are fused 3-D parameters, not `nn.Linear`: they are not LoRA targets (the shared expert is).
With tied embeddings the `row_delta` changes the input embedding only; merging writes it into the shared
matrix, so the tied LM head's row for that token (the `[MASK]` logit, never a target) moves with it.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from clover.training.config import LoraConfig

logger = logging.getLogger(__name__)

ADAPTER_FILE = "adapter.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class LoRALinear(nn.Linear):
    """An `nn.Linear` plus a low-rank update; `weight` and `bias` are the base layer's own parameters."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.merged:
            if not self.enabled:
                raise RuntimeError("cannot disable a merged LoRA adapter; unmerge it first")
            return y
        if not self.enabled:
            return y
        return y + F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """`scaling * B A`, in float64: rounded to the weight's dtype it does not depend on how many threads or
        which kernels summed the rank-r products, so merged weights (and their checksum) are reproducible."""
        return (self.lora_B.double() @ self.lora_A.double()) * self.scaling

    @torch.no_grad()
    def merge(self) -> None:
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

    def __init__(self, base: nn.Embedding, rows: list[int]) -> None:
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

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        if self.merged or not self.enabled:
            return out
        hit = (ids[..., None] == self.rows).to(out.dtype)
        return out + hit @ self.row_delta.to(out.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        if not self.merged:
            self.weight[self.rows] += self.row_delta.to(self.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.weight[self.rows] -= self.row_delta.to(self.weight.dtype)
            self.merged = False


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
    model.requires_grad_(False)
    linear = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    chosen = [(n, m) for n, m in linear if _matches(n, config.targets)]
    if not chosen:
        names = sorted({n.rpartition(".")[2] for n, _ in linear})
        raise ValueError(f"lora.targets {config.targets} match no nn.Linear of the model; its linear layers are "
                         f"named {names}")
    for name, module in chosen:
        _set_child(model, name, LoRALinear(module, config.rank, config.alpha, config.dropout))
    rows = resolve_rows(model, config.train_rows) if config.train_rows else []
    if rows:
        embed_name = next(n for n, m in model.named_modules() if type(m) is nn.Embedding)
        _set_child(model, embed_name, TrainableRowsEmbedding(model.get_submodule(embed_name), rows))
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
    logger.info("LoRA rank %d on %d linear layers, %d embedding rows, %d extra tensors: %d trainable parameters",
                config.rank, len(chosen), len(rows), len(extras), info["trainable_parameters"])
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


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weights and put plain `nn.Linear` / `nn.Embedding` modules back."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            module.merge()
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device="meta")
            plain.weight, plain.bias = module.weight, module.bias
            _set_child(model, name, plain)
        elif isinstance(module, TrainableRowsEmbedding):
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
                                                      "extra_trainable")},
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
