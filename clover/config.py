"""`CloverConfig`: one declarative description of every model Clover runs.

The same dataclass describes the hybrid Qwen3.5-MoE family (Gated DeltaNet + gated attention, sparse MoE,
zero-centred RMSNorm) and the dense Llama/SmolLM2 family (plain RMSNorm, full RoPE, dense SwiGLU, tied
embeddings). Field names follow `transformers` so that `config.json` files read naturally next to the
checkpoints they come from. Defaults *are* a real model: the 35B-A3B text tower.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)
CONTEXT_READINGS = ("block_causal", "causal")
PROMPT_READINGS = ("causal", "blocks")
DELTANET_READINGS = ("block_bidirectional", "causal")
BLOCK_GRIDS = ("prompt_end", "absolute")
# `rope_scaling` (rope_type "llama3", the only scaling Clover computes): the fields transformers' llama3 RoPE reads
LLAMA3_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_threshold(threshold: float, where: str = "threshold") -> float:
    """`threshold` if it is a confidence threshold, else a ValueError naming `where`. The one place the range is
    stated: (0, 1], as 0 would accept every position at once and 1 is one token per step."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"{where} must be in (0, 1], got {threshold!r}")
    return threshold


def _hybrid_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    """Qwen3.5 / Qwen3-Next pattern: every `interval`-th layer (3, 7, ...) is full attention."""
    return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]


@dataclass
class CloverConfig:
    # -- backbone ---------------------------------------------------------------------------------------
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    layer_types: list[str] = field(default_factory=lambda: _hybrid_layer_types(40))
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    norm_type: str = "zero_centered"  # "zero_centered": y = norm(x) * (1 + w); "plain": y = norm(x) * w
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # -- gated attention (full_attention layers) ---------------------------------------------------------
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    # None: plain RoPE. Llama 3.x checkpoints: {"rope_type": "llama3", LLAMA3_ROPE_FIELDS...}, the low frequencies
    # divided by `factor` (clover.model.rope.llama3_inv_freq)
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    attn_output_gate: bool = True  # q_proj yields [query | gate] per head; output *= sigmoid(gate)
    qk_norm: bool = True
    # -- Gated DeltaNet (linear_attention layers) ------------------------------------------------------
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # -- feed-forward -----------------------------------------------------------------------------------
    mlp_type: str = "moe"  # "moe" (routed experts + shared expert) or "dense" (SwiGLU)
    intermediate_size: int = 0  # dense MLP width (dense models, and `mlp_only_layers` of MoE models)
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512  # 0: no shared expert (Qwen3-MoE)
    norm_topk_prob: bool = True
    mlp_only_layers: list[int] = field(default_factory=list)
    # -- tokens ------------------------------------------------------------------------------------------
    mask_token_id: int | None = 248319  # 35B: an unused row of the padded embedding matrix
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None  # set from the source checkpoint by `clover convert`
    pad_token_id: int | None = None
    # -- block diffusion defaults (generation) --------------------------------------------------------
    block_size: int = 16
    threshold: float = 0.9
    rule: str = "threshold"  # the decoding rule by name (clover.engine.decoding.RULES); "exact": drafts verified
    draft_acceptance: list[float] = field(default_factory=list)  # exact mode's prior: the measured chance that
    # draft i is accepted when drafts 1..i-1 were (clover.engine.drafts.drafting); empty: a generic prior
    # How committed context is read: "block_causal" (a committed block reads itself in both directions, as the
    # BD3-LM clean stream is trained) or "causal" (committed tokens are read exactly as the AR base reads them;
    # only the block being decoded is bidirectional). Exact mode's verification reads drafts causally either way.
    context_reading: str = "block_causal"
    # Where a masked position's prediction is read: True (token shift, the AR base's convention: the output at
    # position i predicts token i + 1, so a block's first token comes from the last committed one; Clover, Dream,
    # Fast-dLLM v2) or False (the output at a masked position predicts that position itself; SDAR, LLaDA, dllm's
    # BD3LM). Without the shift no output at a committed token predicts the next one: exact mode is undefined.
    token_shift: bool = True
    # How the prompt is read: "causal" (as the AR base reads it; Clover) or "blocks" (on the block grid, left-padded
    # to whole blocks so the grid ends where the prompt ends and generation starts a fresh block, each block read
    # in both directions; dllm's BD3LM sampler). "blocks" needs context_reading "block_causal".
    prompt_reading: str = "causal"
    # Where that grid lies ("blocks" only): "prompt_end" (it ends where the prompt ends; generation starts a fresh
    # block: dllm's sampler) or "absolute" (blocks at positions 0, B, 2B, ...: SDAR's and Fast-dLLM v2's generators;
    # the prompt's last `len % B` tokens open the first generated block, which the first tokens complete).
    block_grid: str = "prompt_end"
    # How a Gated DeltaNet layer reads the block being decoded: "block_bidirectional" (Clover: every token of the
    # block reads the whole block, docs/design.md §4) or "causal" (arcLM: the recurrence runs on through the block
    # from the committed state, as the AR base reads it; only attention layers read a block in both directions).
    # Committed blocks on the grid (`context_reading` "block_causal") are read the same way; with "causal", every
    # Gated DeltaNet layer is exactly the AR base's recurrence and only the attention layers see the block grid.
    deltanet_reading: str = "block_bidirectional"
    # The released family whose conventions this checkpoint follows (clover.conversion.families); descriptive only:
    # the fields above carry the conventions themselves.
    family: str = "clover"

    model_type: str = "clover"

    def __post_init__(self) -> None:
        self.validate()

    # -- derived ---------------------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @property
    def has_linear_attention(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    def layer_uses_moe(self, layer_idx: int) -> bool:
        return self.mlp_type == "moe" and layer_idx not in self.mlp_only_layers

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"CloverConfig.{name}: {why} (got {getattr(self, name)!r})")

        if len(self.layer_types) != self.num_hidden_layers:
            raise bad("layer_types", f"needs {self.num_hidden_layers} entries, one per layer")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise bad("layer_types", f"unknown types {unknown}; valid: {list(LAYER_TYPES)}")
        if self.norm_type not in ("zero_centered", "plain"):
            raise bad("norm_type", "must be 'zero_centered' or 'plain'")
        if self.mlp_type not in ("moe", "dense"):
            raise bad("mlp_type", "must be 'moe' or 'dense'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", "must divide num_attention_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise bad("linear_num_key_heads", "must divide linear_num_value_heads")
        if self.rotary_dim % 2:
            raise bad("partial_rotary_factor", "head_dim * partial_rotary_factor must be even")
        if self.rope_scaling is not None and (
                self.rope_scaling.get("rope_type") != "llama3"
                or sorted(self.rope_scaling) != sorted(("rope_type",) + LLAMA3_ROPE_FIELDS)):
            raise bad("rope_scaling", f"must be None or rope_type 'llama3' with exactly {list(LLAMA3_ROPE_FIELDS)}")
        if self.mlp_type == "moe" and self.num_experts_per_tok > self.num_experts:
            raise bad("num_experts_per_tok", "cannot exceed num_experts")
        if self.shared_expert_intermediate_size < 0:
            raise bad("shared_expert_intermediate_size", "must be >= 0 (0: no shared expert)")
        if (self.mlp_type == "dense" or self.mlp_only_layers) and self.intermediate_size <= 0:
            raise bad("intermediate_size", "a dense MLP needs intermediate_size > 0")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise bad("mask_token_id", f"must be a token id in [0, {self.vocab_size})")
        if self.block_size < 1:
            raise bad("block_size", "must be >= 1")
        check_threshold(self.threshold, "CloverConfig.threshold")
        if any(not 0.0 <= p <= 1.0 for p in self.draft_acceptance):
            raise bad("draft_acceptance", "must be probabilities in [0, 1]")
        if self.context_reading not in CONTEXT_READINGS:
            raise bad("context_reading", f"must be one of {list(CONTEXT_READINGS)}")
        if self.prompt_reading not in PROMPT_READINGS:
            raise bad("prompt_reading", f"must be one of {list(PROMPT_READINGS)}")
        if self.prompt_reading == "blocks" and self.context_reading != "block_causal":
            raise bad("prompt_reading", "'blocks' reads committed context block-causally, so it needs "
                                        "context_reading 'block_causal'")
        if self.block_grid not in BLOCK_GRIDS:
            raise bad("block_grid", f"must be one of {list(BLOCK_GRIDS)}")
        if self.block_grid == "absolute" and self.prompt_reading != "blocks":
            raise bad("block_grid", "'absolute' places the block grid prompts are read on, so it needs "
                                    "prompt_reading 'blocks'")
        if self.deltanet_reading not in DELTANET_READINGS:
            raise bad("deltanet_reading", f"must be one of {list(DELTANET_READINGS)}")
        if not isinstance(self.token_shift, bool):
            raise bad("token_shift", "must be true or false")

    # -- (de)serialisation --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CloverConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config has unknown keys {unknown}; a Clover config.json takes only {sorted(known)}")
        return cls(**data)

    def save(self, directory: str | Path) -> None:
        path = Path(directory) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_file(cls, path: str | Path) -> "CloverConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no Clover config at {path}")
        data = json.loads(path.read_text())
        if data.get("model_type") != "clover":
            raise ValueError(f"{path}: model_type is {data.get('model_type')!r}, not 'clover'; "
                             "convert it first with `clover convert`")
        return cls.from_dict(data)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "CloverConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


PRESETS: dict[str, dict[str, Any]] = {
    # Qwen3.6-35B-A3B text tower (same shapes as Qwen3.5-35B-A3B), served at 131072 tokens of context.
    "clover-35b-a3b": {},
    # SmolLM2-135M shape: the dense Llama backbone of clover-smol.
    "clover-smol-135m": dict(
        vocab_size=49152, hidden_size=576, num_hidden_layers=30, layer_types=[FULL_ATTENTION] * 30,
        max_position_embeddings=8192, rms_norm_eps=1e-5, norm_type="plain", tie_word_embeddings=True,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
        partial_rotary_factor=1.0, attn_output_gate=False, qk_norm=False, mlp_type="dense",
        intermediate_size=1536, mask_token_id=None, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    ),
    # A ~100M-parameter hybrid (DeltaNet + attention + MoE) for CPU benchmarks of the hybrid path.
    "clover-hybrid-small": dict(
        vocab_size=49152, hidden_size=512, num_hidden_layers=12, layer_types=_hybrid_layer_types(12),
        max_position_embeddings=32768, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=256,
        mask_token_id=49151, eos_token_id=2, bos_token_id=None,
    ),
    # Tiny random models for tests: milliseconds to build and run.
    "clover-tiny": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, layer_types=_hybrid_layer_types(4),
        max_position_embeddings=65536, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        mask_token_id=255, eos_token_id=254, bos_token_id=None, block_size=4,
    ),
    "clover-tiny-dense": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, layer_types=[FULL_ATTENTION] * 2,
        max_position_embeddings=65536, rms_norm_eps=1e-5, norm_type="plain", tie_word_embeddings=True,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
        partial_rotary_factor=1.0, attn_output_gate=False, qk_norm=False, mlp_type="dense",
        intermediate_size=128, mask_token_id=255, eos_token_id=254, bos_token_id=None, block_size=4,
    ),
}
