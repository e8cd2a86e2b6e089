"""The Clover model: decoder layers, backbone and LM head, in the order data flows.

    h = embed(ids)
    for each layer:  h += mixer(input_layernorm(h));  h += mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))

`mixer` is Gated DeltaNet (`linear_attention`) or softmax attention (`full_attention`); `mlp` is the sparse MoE
or a dense SwiGLU. Every forward runs under a `BlockLayout` (clean tokens, query blocks); with `block_size=1`
and no query blocks it is exactly the AR base's forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from clover.checkpoint import load_state_dict_strict, save_checkpoint
from clover.config import CONTEXT_READINGS, LINEAR_ATTENTION, CloverConfig
from clover.engine import generate as engine_generate
from clover.model.attention import ROWS_ALONE, Attention, CleanRows
from clover.model.cache import CloverCache
from clover.model.deltanet import GatedDeltaNet
from clover.model.fused import fused_layers, runs_fused
from clover.model.layout import BlockLayout
from clover.model.lora import ADAPTER_CONFIG, adapter_tensor_names, has_lora, load_adapter, save_adapter
from clover.model.moe import Experts, SparseMoE, SwiGLU, TopKRouter
from clover.model.norms import RMSNorm
from clover.model.prompt_rows import reading_prompt
from clover.model.quant import QUANT_CONFIG, prepare_quantized, save_quantization
from clover.model.rope import RotaryEmbedding


@dataclass
class CloverOutput:
    logits: torch.Tensor  # [N, kept clean positions, V]; with `logits_at`: [selected positions, V]
    query_logits: torch.Tensor | None = None  # [N, query tokens, V]
    hidden_states: torch.Tensor | None = None  # final-norm hidden states of the positions logits are computed for


class DecoderLayer(nn.Module):
    def __init__(self, config: CloverConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        zc = config.norm_type == "zero_centered"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=zc)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=zc)
        if self.layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = Attention(config)
        if config.layer_uses_moe(layer_idx):
            self.mlp: nn.Module = SparseMoE(config)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.fused = False  # set by clover.model.quant where the whole layer can run as one C++ call (fused.py)

    def forward(self, h: torch.Tensor, ctx: "_ForwardContext", cache_layer: Any) -> torch.Tensor:
        if self.fused and ctx.fused:
            return fused_layers([self], h, ctx, None if cache_layer is None else [cache_layer])
        if ctx.gate is not None:  # re-opened per layer: checkpointing recomputes a layer after later forwards
            lc = ctx.layout.clean_len
            ctx.gate.open(h.shape[0], h.shape[1], lc)
            if 0 < lc < h.shape[1] and h.requires_grad:
                # the clean stream is the frozen base: no gradient flows into it from the query stream's reads
                h = torch.cat([h[:, :lc].detach(), h[:, lc:]], dim=1)
        x = self.input_layernorm(h)
        if self.layer_type == LINEAR_ATTENTION:
            x = self.linear_attn(x, ctx.layout, ctx.clean_valid, cache_layer)
        else:
            x = self.self_attn(x, ctx.rope, ctx.mask, ctx.is_causal, ctx.layout.clean_len, cache_layer, ctx.clean_rows)
        h = h + x
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class _ForwardContext:
    layout: BlockLayout
    clean_valid: torch.Tensor | None
    rope: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor | None
    is_causal: bool
    gate: Any = None  # a gated adapter's `AdapterGate` (clover.model.lora), or None
    fused: bool = False  # layers marked `fused` run as one C++ call (clover.model.fused.runs_fused)
    clean_rows: CleanRows | None = None  # how causal clean rows attend (`_clean_rows`)


class _CleanKeys:
    """An attention layer's clean keys/values for `_frozen_clean_layers`, in the place of a cache: the clean pass
    (the first `extend`) stores its own, the query pass reads them before its own (`[N, Hkv, T, D]`)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor, commit: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            self.k, self.v = k, v
            return k, v
        return torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)


class CloverModel(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=config.norm_type == "zero_centered")
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)


class CloverForBlockDiffusion(nn.Module):
    """A Clover model. `model(ids, block_size=1).logits` is the AR forward; `generate` decodes block by block."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.config = config
        self.model = CloverModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False
        self.adapter_gate: Any = None  # set by `apply_lora` for a gated adapter (query positions only)
        self.quantization: dict[str, Any] | None = None  # set by clover.model.quant.quantize
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, Experts):
            nn.init.normal_(module.gate_up_proj, std=std)
            nn.init.normal_(module.down_proj, std=std)
        elif isinstance(module, TopKRouter):
            nn.init.normal_(module.weight, std=std)

    # -- forward ------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]] | None = None,
        block_size: int = 1,
        *,
        prefix_len: int = 0,
        attention_mask: torch.Tensor | None = None,
        cache: CloverCache | None = None,
        query_ids: torch.Tensor | None = None,
        query_start: int | None = None,
        logits_to_keep: int | None = None,
        logits_at: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        context_reading: str | None = None,
        prompt: bool = False,
    ) -> CloverOutput:
        """Run clean tokens `input_ids` `[N, T]` (and optional query blocks `query_ids` `[N, nq * block_size]`).

        * `block_size`, `prefix_len`: clean tokens are a causal prefix of `prefix_len`, then blocks.
        * `context_reading` (default: the config's): "causal" reads every clean token causally, as the AR base
          does; `prefix_len` and `block_size` then only place the query blocks.
        * `attention_mask` `[N, T]`: 1 for real clean tokens, 0 for left padding.
        * `cache`: read, and extended by every clean token. Query tokens are never cached.
        * `query_start`: clean offset of the first query block (default: right after the clean tokens,
          for the last query block).
        * `logits_to_keep`: compute clean logits only for the last this-many positions (0: none).
        * `logits_at` `[N, T + query tokens]` bool: compute logits only where True (clean then query positions);
          `logits` is then `[selected, V]` in row-major order and `query_logits` is None. Training selects the
          few positions it supervises: the LM head is ~20 % of a small model's FLOPs per position.
        * `prompt`: the clean tokens are prompt tokens (a prefill chunk, or the last one with the first query block):
          the layers compute their rows one way however many rows share the forward (clover.model.prompt_rows).
        """
        device = self.model.embed_tokens.weight.device
        ids = self._as_ids(input_ids, device)
        n = ids.shape[0] if ids is not None else (query_ids.shape[0] if query_ids is not None else 1)
        if ids is None:
            ids = torch.zeros(n, 0, dtype=torch.long, device=device)
        lc = ids.shape[1]
        nq = 0 if query_ids is None else query_ids.shape[1] // block_size
        if query_ids is not None and query_ids.shape[1] != nq * block_size:
            raise ValueError(f"query_ids length {query_ids.shape[1]} is not a multiple of block_size {block_size}")
        if query_start is None:
            query_start = lc - max(nq - 1, 0) * block_size
        reading = context_reading or self.config.context_reading
        if reading not in CONTEXT_READINGS:
            raise ValueError(f"context_reading must be one of {list(CONTEXT_READINGS)}, got {reading!r}")
        layout = BlockLayout(lc, block_size, prefix_len if block_size > 1 else lc, nq, query_start,
                             causal_clean=reading == "causal")
        if lc + nq == 0:
            raise ValueError("forward needs at least one clean token or one query block")
        if logits_at is not None:
            if logits_to_keep is not None:
                raise ValueError("pass logits_to_keep or logits_at, not both")
            if tuple(logits_at.shape) != (n, lc + nq * block_size) or logits_at.dtype != torch.bool:
                raise ValueError(f"logits_at must be a bool tensor of shape {(n, lc + nq * block_size)} "
                                 f"(clean then query positions), got {logits_at.dtype} {tuple(logits_at.shape)}")

        clean_valid = None
        if attention_mask is not None:
            if attention_mask.shape != ids.shape:
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(ids.shape)}")
            clean_valid = attention_mask.to(device=device, dtype=torch.bool)
        all_ids = ids if query_ids is None else torch.cat([ids, query_ids.to(device)], dim=1)
        self._check_ids(all_ids)

        # positions: continue after the cache; padding does not advance them
        start = cache.next_position if cache is not None else torch.zeros(n, dtype=torch.long, device=device)
        valid_i = clean_valid.long() if clean_valid is not None else torch.ones_like(ids)
        before = torch.cat([valid_i.new_zeros(n, 1), valid_i.cumsum(1)], dim=1)  # valid clean tokens before i
        positions = [start[:, None] + (before[:, 1:] - 1).clamp(min=0)]
        if nq:
            qs = layout.query_block_starts(device)
            in_block = torch.arange(layout.query_len, device=device) % block_size
            positions.append(start[:, None] + before[:, qs] + in_block[None])
        positions_t = torch.cat(positions, dim=1)
        self._check_context(positions_t)

        gate = self.adapter_gate
        if gate is not None:
            gate.open(n, all_ids.shape[1], lc)
        h = self.model.embed_tokens(all_ids)
        past_valid = cache.past_valid() if cache is not None else None
        mask, is_causal = layout.attention_mask(past_valid, clean_valid, n, device)
        ctx = _ForwardContext(layout, clean_valid, self.model.rotary(positions_t, h.dtype), mask, is_causal, gate)
        ctx.clean_rows = self._clean_rows(layout, past_valid, clean_valid, mask, is_causal, n, device)
        with reading_prompt(prompt):  # the layers read it (the LM head below does not)
            ctx.fused = any(layer.fused for layer in self.model.layers) and runs_fused(h, ctx)
            if self._runs_frozen_clean(ctx, cache):
                h = self._frozen_clean_layers(h, ctx)
            elif ctx.fused and self._all_fused():
                h = fused_layers(self.model.layers, h, ctx, cache.layers if cache is not None else None)
            else:
                for i, layer in enumerate(self.model.layers):
                    cache_layer = cache.layers[i] if cache is not None else None
                    h = self._layer(layer, h, ctx, cache_layer)
        if cache is not None and lc:
            cache.commit(clean_valid if clean_valid is not None else torch.ones_like(ids, dtype=torch.bool))

        keep = lc if logits_to_keep is None else min(logits_to_keep, lc)
        if logits_at is not None:
            hidden = self.model.norm(h[logits_at.to(device)])
        else:
            hidden = self.model.norm(torch.cat([h[:, lc - keep : lc], h[:, lc:]], dim=1))
        with reading_prompt(False):  # the head reads only the rows kept for logits: the decoding path
            logits = self.lm_head(hidden)
        if logits_at is not None:
            return CloverOutput(logits=logits, hidden_states=hidden if output_hidden_states else None)
        return CloverOutput(
            logits=logits[:, :keep],
            query_logits=logits[:, keep:] if nq else None,
            hidden_states=hidden if output_hidden_states else None,
        )

    @staticmethod
    def _clean_rows(layout: BlockLayout, past_valid: torch.Tensor | None, clean_valid: torch.Tensor | None,
                    mask: torch.Tensor | None, is_causal: bool, n: int, device: torch.device) -> CleanRows | None:
        """Where every clean row is causal, each gets the attention bits it gets in a forward without the rows after
        it (clover.model.attention): the clean rows attend apart from query rows, with the mask of a forward of
        them alone; and 2 .. `ROWS_ALONE` of them after a cache (a decoding step, exact mode's drafts) attend one
        at a time, each with the mask of a one-row forward at its place (None where no row of the batch is padded
        up to it). None: every row in one call (no causal rows to keep apart)."""
        lc, past = layout.clean_len, 0 if past_valid is None else past_valid.shape[1]
        if lc == 0 or layout.causal_len != lc:
            return None
        alone = 1 < lc <= ROWS_ALONE and past > 0
        if layout.query_len == 0 and not alone:
            return None
        if layout.query_len:
            mask, is_causal = BlockLayout(lc, causal_clean=True).attention_mask(past_valid, clean_valid, n, device)
        if not alone:
            return CleanRows(mask, is_causal)
        rows = []
        for i in range(lc):
            row = None if mask is None else mask[:, :, i : i + 1, : past + i + 1]
            rows.append(None if row is None or bool(row.all()) else row)
        return CleanRows(mask, is_causal, rows)

    def _layer(self, layer: DecoderLayer, h: torch.Tensor, ctx: _ForwardContext, cache_layer: Any) -> torch.Tensor:
        if self.gradient_checkpointing and self.training:
            return checkpoint(layer, h, ctx, cache_layer, use_reentrant=False)
        return layer(h, ctx, cache_layer)

    def _all_fused(self) -> bool:
        """Whether every layer takes the fused C++ path, so the stack can run as one call (no layer hooks to call
        between them)."""
        return all(layer.fused and not (layer._forward_hooks or layer._forward_pre_hooks)
                   for layer in self.model.layers)

    def _runs_frozen_clean(self, ctx: _ForwardContext, cache: CloverCache | None) -> bool:
        """Whether a forward takes `_frozen_clean_layers`: a gated adapter under autograd, clean and query tokens,
        no cache, attention layers only (a DeltaNet layer hands its state from the clean stream to each query
        block inside its own call)."""
        layout = ctx.layout
        return (ctx.gate is not None and torch.is_grad_enabled() and cache is None and layout.clean_len > 0
                and layout.query_len > 0 and all(layer.layer_type != LINEAR_ATTENTION for layer in self.model.layers))

    def _frozen_clean_layers(self, h: torch.Tensor, ctx: _ForwardContext) -> torch.Tensor:
        """The layers with a gated adapter's clean stream run once under `torch.no_grad()`.

        Clean rows never attend to query keys and the gated adapter is off at clean positions, so the clean
        stream is the frozen base whatever the query tokens: `h_c^(l+1) = layer_l(h_c^l)` (the clean rows of the
        layout's mask) is computed with no autograd record, and only the query stream is recorded,
        `h_q^(l+1) = layer_l(h_q^l | keys/values [K_c^l (constants) | K_q^l])` with the query rows of the mask.
        Same outputs as one pass over both streams with the clean input detached at every layer, without keeping
        the clean stream's activations (2 (P + R) of the 2 (P + R) + 2 R positions of a training sample)."""
        layout, lc = ctx.layout, ctx.layout.clean_len
        n = h.shape[0]
        cos, sin = ctx.rope
        clean_layout = BlockLayout(lc, layout.block_size, layout.prefix_len, causal_clean=layout.causal_clean)
        clean_mask, clean_causal = clean_layout.attention_mask(None, ctx.clean_valid, n, h.device)
        clean_ctx = _ForwardContext(clean_layout, ctx.clean_valid, (cos[:, :, :lc], sin[:, :, :lc]), clean_mask,
                                    clean_causal, ctx.gate)
        # an empty clean layout: the gate adapts every position of the query-only input
        query_ctx = _ForwardContext(BlockLayout(0), None, (cos[:, :, lc:], sin[:, :, lc:]), ctx.mask[:, :, lc:],
                                    False, ctx.gate)
        clean, query = h[:, :lc].detach(), h[:, lc:]  # the embedding's [MASK] row delta is gated: base at clean rows
        for layer in self.model.layers:
            keys = _CleanKeys()
            with torch.no_grad():
                clean = layer(clean, clean_ctx, keys)
            query = self._layer(layer, query, query_ctx, keys)
        return torch.cat([clean, query], dim=1)

    @staticmethod
    def _as_ids(input_ids: Any, device: torch.device) -> torch.Tensor | None:
        if input_ids is None:
            return None
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=device) if not torch.is_tensor(input_ids) \
            else input_ids.to(device=device, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(ids.shape)}")
        return ids

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), "
                             f"got range [{int(ids.min())}, {int(ids.max())}]")

    def _check_context(self, positions: torch.Tensor) -> None:
        limit = self.config.max_position_embeddings
        if positions.numel() and int(positions.max()) >= limit:
            raise ValueError(f"context of {int(positions.max()) + 1} tokens exceeds the model's "
                             f"max_position_embeddings={limit}")

    def new_cache(self, batch_size: int) -> CloverCache:
        return CloverCache(self.config, batch_size, device=self.model.embed_tokens.weight.device)

    # -- generation --------------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor | Sequence[Sequence[int]], max_new_tokens: int = 128,
                 block_size: int | None = None, threshold: float | None = None, **sampling: Any) -> Any:
        """Block-diffusion decoding (docs/design.md §6): token-id lists or a 2-D tensor in; a `GenerationResult`
        with `.sequences` (new ids, EOS excluded) and `.stats` out. `block_size` / `threshold` default to the
        config's; other keywords go to `clover.engine.generate` (temperature, top_p, top_k, seed, rule, ...)."""
        return engine_generate(self, input_ids, max_new_tokens, block_size=block_size, threshold=threshold, **sampling)

    # -- counting -----------------------------------------------------------------------------------------
    def num_parameters(self) -> int:
        """All parameters (a tied embedding / LM head matrix counted once)."""
        return sum(p.numel() for p in self.parameters())

    def num_active_parameters(self, include_embeddings: bool = True) -> int:
        """Parameters that take part in computing one token's output.

        Routed experts count `top_k / num_experts` of their weights; the input embedding table is a lookup,
        not compute, so it is not counted (unless tied, when it is the LM head). With
        `include_embeddings=False` the LM head is left out too.
        """
        total = self.num_parameters()
        if not self.config.tie_word_embeddings:
            total -= self.model.embed_tokens.weight.numel()
        if not include_embeddings:
            total -= self.config.hidden_size * self.config.vocab_size
        for module in self.modules():
            if isinstance(module, Experts):
                routed = module.gate_up_proj.numel() + module.down_proj.numel()
                total -= routed - routed * self.config.num_experts_per_tok // self.config.num_experts
        return total

    # -- checkpoints -------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> "CloverForBlockDiffusion":
        """Load a checkpoint directory; an adapter stored next to the weights (`adapter_config.json`, as
        `save_pretrained` writes for a model with an unmerged, e.g. gated, adapter) is applied and loaded; a
        quantised checkpoint (`quantization.json`, clover.model.quant) loads as the packed modules it stores."""
        config = CloverConfig.from_file(directory)
        with torch.device("meta"), _no_init():  # no random init, no second copy of the weights
            model = cls(config)
        if dtype is not None:
            model.to(dtype=dtype)  # free on meta; loading then casts tensor by tensor (no full-precision copy)
        if (Path(directory) / QUANT_CONFIG).is_file():
            prepare_quantized(model, directory)  # packed modules of the stored format (their bits are kept)
        load_state_dict_strict(model, directory)
        if (Path(directory) / ADAPTER_CONFIG).is_file():
            load_adapter(model, directory)
        if device is not None:
            model.to(device=device)
        return model.eval()

    def save_pretrained(self, directory: str | Path, tokenizer_dir: str | Path | None = None) -> None:
        """Save as a checkpoint directory; an unmerged adapter goes next to the base weights
        (`adapter.safetensors` + `adapter_config.json`), which `from_pretrained` restores."""
        if getattr(self, "quantization", None):  # quantised models carry no adapter (clover.model.quant)
            save_checkpoint(self, directory, tokenizer_dir=tokenizer_dir,
                            extra=lambda tmp: save_quantization(self, tmp))
            return
        if not has_lora(self):
            save_checkpoint(self, directory, tokenizer_dir=tokenizer_dir)
            return
        adapter = adapter_tensor_names(self)
        save_checkpoint(self, directory, tokenizer_dir=tokenizer_dir, exclude=adapter,
                        extra=lambda tmp: save_adapter(self, tmp, self.lora_config))


@contextmanager
def _no_init() -> Iterator[None]:
    """`torch.nn.init`'s initialisers as no-ops, for a model built on the meta device whose weights are loaded next:
    on meta tensors they run through `torch._refs`, whose first call imports `torch._dynamo` (seconds of a
    command's start on a small CPU) to initialise values that do not exist."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_") and callable(getattr(nn.init, n))]
    saved = {n: getattr(nn.init, n) for n in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
