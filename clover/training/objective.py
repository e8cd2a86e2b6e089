"""The block-diffusion training objective (BD3-LM, vectorised), and a block-by-block reference.

One sample is a clean sequence `x` = prompt (`P` tokens, a causal prefix, never masked) + response (`nb` blocks
of `B` tokens, padded with `[MASK]`), plus a noised copy `x~` of the response: in block `j` each supervised
position is replaced by `[MASK]` with the block's mask rate `r_j`. One forward runs both streams
(`model(x, B, prefix_len=P, query_ids=x~, query_start=P)`)::

    keys ->        prompt   clean b0  clean b1 | noised b0  noised b1
    prompt         causal      .         .     |    .          .
    clean b0        all      both        .     |    .          .
    clean b1        all      all       both    |    .          .
    noised b0       all        .         .     |  both         .
    noised b1       all      all         .     |    .        both

(`both`: bidirectional inside the block; the clean stream's DeltaNet state at a block start feeds the noised
block, exactly as the cache does at decoding time.)

Token shift (docs/design.md §2): the prediction for response position `p` is the output at `p - 1`. For the first
position of block `j` that is the clean stream's output at `P + jB - 1` (the commit forward of block `j - 1` at
decoding time); for the others it is the noised block's output at `p - 1`. The loss is cross-entropy on masked
supervised positions only; `[MASK]` padding is never a target (or, with `pad_target="eos"`, EOS padding is).

Complementary masks: each sample also appears as a second row with the inverse mask (over its supervised
positions), so every supervised token is predicted exactly once per sample. The model's layout takes one
noised copy per row, so the complement costs a second clean stream (2 x (P + R) + 2 x R tokens in all).

Weighting (`noise.weighting`): "none" = mean CE over the masked tokens; "inverse_rate" = BD3-LM's NELBO:
sum of CE / r_j over masked tokens divided by the supervised tokens of all copies (`r` clamped at 1e-3).

The optional AR term is the causal (block_size 1) next-token cross-entropy of the clean sequence on the
supervised tokens: the model's own AR loss, to keep AR quality. (Inside the block-causal clean stream every
non-final position sees its successor, so it cannot serve as an AR loss.) The optional KL term is
KL(base || model) of the same causal predictions against a frozen reference (LoRA: the adapters switched off).

The optional confidence term (`confidence_weight`; dParallel's certainty forcing, LLaDA2.0's CAP) is the mean
entropy of the predicted distribution at masked positions whose argmax is already the target: it sharpens
predictions that are right but not yet confident enough to pass a decoding threshold, and leaves wrong ones to
the cross-entropy. Normalised by the masked tokens (known before the forward).

With a model whose `context_reading` is "causal" (a gated adapter), the clean stream is read causally rather than
block-causally: a block's first position is then the base's own next-token prediction. A gated adapter's block
starts get no gradient, so they count in no denominator (`loss_denominators(..., frozen_starts=True)`); their CE
is still logged (`first_ce`).

Exact decoding drafts positions 1..B-1 of a fully masked block; the options aimed at it (docs/training.md):
`noise.full_mask_prob` (a fraction of blocks fully masked), `noise.position_decay` (draft weight
`gamma^(p-1)` at block position `p`, the loss a weighted mean), and `draft_kl_weight` (KL to the base's
next-token distribution, read off the causal clean stream at `P + p - 1`). An answer's untrained tail (the
newline after `<|im_end|>`) is shown as `[MASK]` in the noised copies (`Batch.tail`): decoding never sees it.

`reference_block_loss` computes the diffusion term the obvious way, one forward per block
(`model(clean[:start], B, prefix_len=P, query_ids=noised block)`, as decoding runs it); the tests prove the
vectorised form equals it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from clover.model.lora import is_gated
from clover.training.batches import Batch
from clover.training.config import NoiseConfig

RATE_FLOOR = 1e-3  # inverse-rate weights are 1 / max(r, RATE_FLOOR)

# A reference for the KL term: (input_ids, attention_mask, logits_to_keep) -> causal logits, no grad.
ReferenceFn = Callable[[torch.Tensor, torch.Tensor | None, int], torch.Tensor]


# -- noise -----------------------------------------------------------------------------------------------------
@dataclass
class Noise:
    """Masks of the noised copies: `mask` `[copies * N, R]` (copy-major rows), `rate` `[copies * N, nb]`."""

    mask: torch.Tensor
    rate: torch.Tensor
    copies: int
    weighting: str = "none"
    position_decay: float = 1.0  # draft weights decay^(p - 1) (`position_weights`)

    @property
    def block_size(self) -> int:
        return self.mask.shape[1] // self.rate.shape[1]


def mask_rate(t: torch.Tensor, schedule: str) -> torch.Tensor:
    if schedule == "linear":
        return t
    if schedule == "cosine":
        return 1.0 - torch.cos(0.5 * math.pi * t)
    raise ValueError(f"unknown noise schedule {schedule!r}")


def sample_noise(batch: Batch, block_size: int, config: NoiseConfig) -> Noise:
    """Draw each row's masks from its own seed (so a document's noise does not depend on the batch it is in).

    Per block: `t ~ U(t_min, t_max)`, rate `r = schedule(t)`; "bernoulli" masks each supervised position with
    probability `r`, "exact" masks `ceil(r n)` of the block's `n` supervised positions (at least one). With
    probability `full_mask_prob` a block is instead masked at all its supervised positions (rate 1: the block
    exact decoding drafts from). The complementary copy masks exactly the supervised positions the first one
    leaves, with rate `1 - r` (or the realised fraction for "exact"; nothing in a fully masked block).
    """
    n, length = batch.rows, batch.response_len
    nb_all = length // block_size
    if nb_all * block_size != length:
        raise ValueError(f"response length {length} is not a multiple of block_size {block_size}")
    mask = torch.zeros(n, length, dtype=torch.bool)
    rate = torch.ones(n, nb_all)
    comp_rate = torch.ones(n, nb_all)
    loss_mask = batch.loss_mask.cpu()
    for i in range(n):
        nb = batch.num_blocks[i]
        seed = batch.seeds[i] if i < len(batch.seeds) and batch.seeds[i] is not None else \
            int(torch.randint(0, 2**62, ()).item())
        gen = torch.Generator().manual_seed(int(seed))
        t = config.t_min + (config.t_max - config.t_min) * torch.rand(nb, generator=gen)
        r = mask_rate(t, config.schedule)
        u = torch.rand(nb, block_size, generator=gen)
        sup = loss_mask[i, : nb * block_size].view(nb, block_size)
        full = torch.rand(nb, generator=gen) < config.full_mask_prob  # drawn last: t and u as without it
        if config.sampling == "bernoulli":
            m = ((u < r[:, None]) | full[:, None]) & sup
            r = torch.where(full, 1.0, r)
            rate[i, :nb], comp_rate[i, :nb] = r, 1.0 - r
        else:
            n_sup = sup.sum(1)
            k = torch.minimum(torch.ceil(r * n_sup).long().clamp(min=1), n_sup)
            k = torch.where(full, n_sup, k)
            order = torch.where(sup, u, torch.full_like(u, 2.0)).argsort(dim=1).argsort(dim=1)  # rank of u
            m = (order < k[:, None]) & sup
            frac = k.float() / n_sup.clamp(min=1).float()
            rate[i, :nb], comp_rate[i, :nb] = frac, 1.0 - frac
        mask[i, : nb * block_size] = m.flatten()
    if not config.complementary:
        return Noise(mask, rate, 1, config.weighting, config.position_decay)
    comp = loss_mask & ~mask
    return Noise(torch.cat([mask, comp]), torch.cat([rate, comp_rate]), 2, config.weighting,
                 config.position_decay)


def position_weights(block_size: int, decay: float) -> torch.Tensor:
    """`w_p = decay^max(p - 1, 0)` for block position `p` `[block_size]`: the draft at position `p >= 1` is
    accepted only if the `p - 1` drafts before it are (DFlash), so early drafts matter most; the block start
    (the verifier's own token in exact decoding) weighs 1."""
    return decay ** (torch.arange(block_size) - 1).clamp(min=0).double()


def _grid(noise: Noise) -> tuple[torch.Tensor, torch.Tensor]:
    """Per response position `[R]`: whether it starts a block, and its position weight."""
    b, r = noise.block_size, noise.mask.shape[1]
    start = torch.arange(r) % b == 0
    return start, position_weights(b, noise.position_decay).repeat(r // b)


def loss_denominators(batch: Batch, noise: Noise, frozen_starts: bool = False) -> dict[str, float]:
    """Normalisers of the loss terms, known before the forward (so accumulation / DDP can use global ones).

    Only trained positions count: with `frozen_starts` (a gated adapter) a block's first position is predicted
    by the frozen clean stream and gets no gradient, so it is left out of every diffusion denominator.
    "diffusion": sum of position weights `w` over trained masked positions (or, "inverse_rate", over trained
    supervised positions of every copy); "masked": trained masked positions (the confidence term); "draft":
    sum of `w` over masked positions after a block's first (the draft KL); "ar": supervised tokens.
    """
    start, w = _grid(noise)
    frozen = start if frozen_starts else torch.zeros_like(start)
    mask = noise.mask.cpu()
    trained = mask & ~frozen
    if noise.weighting == "inverse_rate":
        diffusion = float(((batch.loss_mask.cpu() & ~frozen).double() @ w).sum()) * noise.copies
    else:
        diffusion = float((trained.double() @ w).sum())
    return {"diffusion": diffusion, "ar": float(batch.loss_mask.sum()), "masked": float(trained.sum()),
            "draft": float(((mask & ~start).double() @ w).sum())}


# -- the loss --------------------------------------------------------------------------------------------------
def _position_weights(noise: Noise, pos: torch.Tensor) -> torch.Tensor | None:
    """`w_p` of response positions `pos` (`position_weights`), or None when the decay is off."""
    if noise.position_decay == 1.0:
        return None
    b = noise.block_size
    return position_weights(b, noise.position_decay).float().to(pos.device)[pos % b]


def _token_weights(noise: Noise, rows: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """CE weight of masked positions `(rows, pos)`: `1 / r` ("inverse_rate") times `w_p`; None for all ones."""
    if noise.weighting not in ("none", "inverse_rate"):
        raise ValueError(f"unknown loss weighting {noise.weighting!r}")
    weights = _position_weights(noise, pos)
    if noise.weighting == "inverse_rate":
        rate = noise.rate.to(pos.device)[rows, torch.div(pos, block_size, rounding_mode="floor")]
        inverse = 1.0 / rate.clamp(min=RATE_FLOOR)
        weights = inverse if weights is None else inverse * weights
    return weights


def _masked_terms(logp: torch.Tensor, targets: torch.Tensor, first: torch.Tensor, trained: torch.Tensor,
                  weights: torch.Tensor | None, confidence: bool = False) -> dict[str, torch.Tensor]:
    """Sums over masked positions given their log-probabilities `logp` `[M, V]`: the (weighted) CE and the
    confidence entropy over the `trained` ones; plain CE, first-position CE and hits over all (metrics)."""
    ce = F.nll_loss(logp, targets, reduction="none")
    weighted = ce if weights is None else ce * weights
    right = logp.detach().argmax(-1) == targets
    correct = right.sum()
    terms = {}
    if confidence:  # entropy -sum p log p where the argmax is already right (CAP / certainty forcing)
        sure = right & trained
        terms["confidence_sum"] = -(logp[sure].exp() * logp[sure]).sum()
        terms["confident"] = sure.sum()
    return terms | {
        "diffusion_sum": weighted[trained].sum(),
        "ce_sum": ce.detach().sum(),
        "first_sum": ce.detach()[first].sum(),
        "first_count": first.sum(),
        "masked": torch.tensor(float(ce.numel()), device=ce.device),
        "correct": correct,
    }


def _draft_kl(logp: torch.Tensor, base_logits: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """`sum_i w_i KL(q_i || p_i) = sum_i w_i sum_v q_iv (log q_iv - log p_iv)`: drafts `p = exp(logp)` `[M, V]`
    against the base's next-token distributions `q = softmax(base_logits)` (constants)."""
    base = base_logits.detach().float().log_softmax(-1)
    kl = (base.exp() * (base - logp)).sum(-1)
    return kl.sum() if weights is None else (kl * weights).sum()


def _mean(total: torch.Tensor, den: float) -> torch.Tensor:
    """`total / den`, or 0 (with a gradient path) when nothing is counted: weighted denominators may be < 1."""
    return total / den if den > 0 else total * 0.0


def _finish(terms: dict[str, torch.Tensor], den: dict[str, float], ar_weight: float, kl_weight: float,
            ar_sum: torch.Tensor | None, kl_sum: torch.Tensor | None, confidence_weight: float = 0.0,
            ce_weight: float = 1.0, draft_kl_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    diffusion = _mean(terms["diffusion_sum"], den["diffusion"])
    loss = ce_weight * diffusion
    if "confidence_sum" in terms:
        loss = loss + confidence_weight * _mean(terms["confidence_sum"], den["masked"])
    masked = float(terms["masked"])
    first = float(terms["first_count"])
    metrics = {
        "diffusion_loss": float(diffusion.detach()),
        "masked_ce": float(terms["ce_sum"]) / max(masked, 1.0),
        "first_ce": float(terms["first_sum"]) / max(first, 1.0),
        "inner_ce": float(terms["ce_sum"] - terms["first_sum"]) / max(masked - first, 1.0),
        "accuracy": float(terms["correct"]) / max(masked, 1.0),
        "masked_tokens": masked,
        "first_tokens": first,
        "supervised_tokens": den["ar"],
        "diffusion_sum": float(terms["diffusion_sum"].detach()),
        "ce_sum": float(terms["ce_sum"]),
        "first_sum": float(terms["first_sum"]),
        "correct": float(terms["correct"]),
    }
    if "confidence_sum" in terms:  # mean entropy over the correctly predicted trained masked tokens
        metrics["confidence_sum"] = float(terms["confidence_sum"].detach())
        metrics["confident"] = float(terms["confident"])
        metrics["confident_entropy"] = metrics["confidence_sum"] / max(metrics["confident"], 1.0)
    if "draft_kl_sum" in terms:
        draft_kl = _mean(terms["draft_kl_sum"], den["draft"])
        metrics["draft_kl"] = float(draft_kl.detach())
        metrics["draft_kl_sum"] = float(terms["draft_kl_sum"].detach())
        loss = loss + draft_kl_weight * draft_kl
    if ar_sum is not None:
        ar = ar_sum / max(den["ar"], 1.0)
        metrics["ar_loss"] = float(ar.detach())
        metrics["ar_sum"] = float(ar_sum.detach())
        if ar_weight:
            loss = loss + ar_weight * ar
    if kl_sum is not None:
        kl = kl_sum / max(den["ar"], 1.0)
        metrics["kl"] = float(kl.detach())
        metrics["kl_sum"] = float(kl_sum.detach())
        loss = loss + kl_weight * kl
    metrics["loss"] = float(loss.detach())
    return loss, metrics


@dataclass
class MaskedLogits:
    """The predictions of every masked token of a noised batch (one entry per `noise.mask` True, row-major)."""

    rows: torch.Tensor  # row of the noised copies (copy-major)
    pos: torch.Tensor  # response position
    first: torch.Tensor  # the block's first position (predicted by the clean stream, i.e. causally)
    targets: torch.Tensor  # the true token there
    logits: torch.Tensor  # [M, V]
    clean: torch.Tensor | None = None  # the clean stream's logits at P + pos - 1 of the draft (not first) entries


def masked_logits(model: torch.nn.Module, batch: Batch, block_size: int, noise: Noise, mask_id: int, *,
                  clean_at_drafts: bool = False) -> MaskedLogits:
    """One vectorised forward of the clean stream and the noised copies, logits only where a masked token is
    predicted: a block's first position from the clean output at `P + pos - 1`, the others from the noised
    block's output at `pos - 1` (the query stream, which follows the `P + R` clean positions). With
    `clean_at_drafts`, also the clean output at `P + pos - 1` of the others (with causal context reading: the
    base's next-token distribution given the true prefix)."""
    p, r = batch.prompt_len, batch.response_len
    device = batch.input_ids.device
    c = noise.copies
    ids = batch.input_ids.repeat(c, 1)
    attention = batch.attention_mask.repeat(c, 1) if batch.padded else None
    mask = noise.mask.to(device)
    response = ids[:, p:]
    hidden = mask if batch.tail is None else mask | batch.tail.to(device).repeat(c, 1)
    query = torch.where(hidden, torch.full_like(response, mask_id), response)
    rows, pos = mask.nonzero(as_tuple=True)
    first = pos % block_size == 0
    length = ids.shape[1]
    width = length + r
    column = torch.where(first, p + pos - 1, length + pos - 1)
    at = torch.zeros(ids.shape[0], width, dtype=torch.bool, device=device)
    at[rows, column] = True
    draft = ~first
    if clean_at_drafts:
        at[rows[draft], p + pos[draft] - 1] = True
    index = at.flatten().cumsum(0) - 1  # the model returns the selected logits in row-major order
    logits = model(ids, block_size, prefix_len=p, attention_mask=attention, query_ids=query, query_start=p,
                   logits_at=at).logits
    clean = logits[index[rows[draft] * width + p + pos[draft] - 1]] if clean_at_drafts else None
    return MaskedLogits(rows, pos, first, response[rows, pos], logits[index[rows * width + column]], clean)


def bd3_loss(model: torch.nn.Module, batch: Batch, block_size: int, noise: Noise | NoiseConfig, *,
             mask_token_id: int | None = None, ar_weight: float = 0.0, kl_weight: float = 0.0,
             confidence_weight: float = 0.0, reference: ReferenceFn | None = None,
             denominators: dict[str, float] | None = None, ce_weight: float = 1.0,
             draft_kl_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """BD3-LM loss of `batch` in one vectorised forward (+ one causal forward for the AR / KL terms).

    `noise`: a `Noise` (fixed masks) or a `NoiseConfig` (drawn with `sample_noise` from the rows' seeds).
    `denominators`: the normalisers (`loss_denominators`); the trainer passes global ones so that gradient
    accumulation and data parallelism give the gradient of one big batch. Returns `(loss, metrics)`; the
    metrics hold means for logging and raw sums for aggregation.

    `ce_weight` scales the diffusion CE; `draft_kl_weight` adds the draft KL (`_draft_kl`): at each masked
    position `p` after a block's first, KL(base || model) against the clean stream's output at `P + p - 1`,
    which with causal context reading is the base's next-token distribution given the true prefix.
    """
    if isinstance(noise, NoiseConfig):
        noise = sample_noise(batch, block_size, noise)
    config = getattr(model, "config", None)
    mask_id = mask_token_id if mask_token_id is not None else getattr(config, "mask_token_id", None)
    if mask_id is None:
        raise ValueError("the model has no mask_token_id: set config.mask_token_id (or pass mask_token_id)")
    p, r = batch.prompt_len, batch.response_len
    if p < 1:
        raise ValueError("batch.prompt_len must be >= 1: the first response token is predicted from the prompt")
    if r % block_size:
        raise ValueError(f"response length {r} is not a multiple of block_size {block_size}")
    if draft_kl_weight and getattr(config, "context_reading", None) != "causal":
        raise ValueError("draft_kl_weight > 0 needs a model whose context_reading is 'causal' (a gated adapter): "
                         "only then is the clean stream's output the base's next-token distribution")
    frozen = is_gated(model)
    den = denominators or loss_denominators(batch, noise, frozen_starts=frozen)
    m = masked_logits(model, batch, block_size, noise, mask_id, clean_at_drafts=bool(draft_kl_weight))
    logp = m.logits.float().log_softmax(-1)
    draft = ~m.first
    trained = draft if frozen else torch.ones_like(m.first)
    terms = _masked_terms(logp, m.targets, m.first, trained, _token_weights(noise, m.rows, m.pos, block_size),
                          confidence=confidence_weight > 0)
    if draft_kl_weight:
        terms["draft_kl_sum"] = _draft_kl(logp[draft], m.clean, _position_weights(noise, m.pos[draft]))

    ar_sum = kl_sum = None
    if ar_weight or kl_weight:
        ar_sum, kl_sum = _causal_terms(model, batch, kl_weight, reference)
    return _finish(terms, den, ar_weight, kl_weight, ar_sum, kl_sum, confidence_weight, ce_weight, draft_kl_weight)


def _causal_terms(model: torch.nn.Module, batch: Batch, kl_weight: float,
                  reference: ReferenceFn | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    p, r = batch.prompt_len, batch.response_len
    attention = batch.attention_mask if batch.padded else None
    sel = batch.loss_mask
    at = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    at[:, p - 1: p - 1 + r] = sel  # response token i is predicted at P - 1 + i
    chosen = model(batch.input_ids, 1, attention_mask=attention, logits_at=at).logits.float()
    ar_sum = F.cross_entropy(chosen, batch.response[sel], reduction="sum")
    kl_sum = None
    if kl_weight:
        if reference is None:
            raise ValueError("kl_weight > 0 needs a reference model")
        with torch.no_grad():
            ref = reference(batch.input_ids, attention, r + 1)[:, :r][sel].float().log_softmax(-1)
        kl_sum = (ref.exp() * (ref - chosen.log_softmax(-1))).sum()
    return ar_sum, kl_sum


def reference_block_loss(model: torch.nn.Module, batch: Batch, block_size: int, noise: Noise, *,
                         mask_token_id: int | None = None,
                         confidence_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The diffusion (and confidence) terms of `bd3_loss`, computed block by block: for each noised block `j`,
    one forward of `clean[:P + jB]` with `prefix_len=P` and the noised block `j` as the query block (as decoding
    runs it); block `j`'s first position is predicted by the clean output at `P + jB - 1`, the others by the
    noised block's outputs one position to their left."""
    mask_id = mask_token_id if mask_token_id is not None else model.config.mask_token_id
    p, r, n = batch.prompt_len, batch.response_len, batch.rows
    b = block_size
    frozen = is_gated(model)
    pieces: dict[str, list[torch.Tensor]] = {}
    for c in range(noise.copies):
        rows_c = slice(c * n, (c + 1) * n)
        mask_c = noise.mask[rows_c].to(batch.input_ids.device)
        for j in range(r // b):
            start = p + j * b
            block_mask = mask_c[:, j * b: (j + 1) * b]
            block = batch.input_ids[:, start: start + b]
            hidden = block_mask if batch.tail is None else block_mask | batch.tail[:, j * b: (j + 1) * b]
            noised = torch.where(hidden, torch.full_like(block, mask_id), block)
            attention = batch.attention_mask[:, :start] if batch.padded else None
            out = model(batch.input_ids[:, :start], b, prefix_len=p, attention_mask=attention, query_ids=noised)
            shifted = torch.cat([out.logits[:, -1:], out.query_logits[:, :-1]], dim=1)  # position i from i - 1
            rows, off = block_mask.nonzero(as_tuple=True)
            logits = shifted[rows, off]
            targets = batch.input_ids[rows, start + off]
            pos = j * b + off
            weights = _token_weights(noise, rows + c * n, pos, b)
            trained = off > 0 if frozen else torch.ones_like(off, dtype=torch.bool)
            terms = _masked_terms(logits.float().log_softmax(-1), targets, off == 0, trained, weights,
                                  confidence=confidence_weight > 0)
            for k, v in terms.items():
                pieces.setdefault(k, []).append(v)
    total = {k: torch.stack([torch.as_tensor(x, dtype=torch.float, device=v[0].device) for x in v]).sum()
             for k, v in pieces.items()}
    return _finish(total, loss_denominators(batch, noise, frozen_starts=frozen), 0.0, 0.0, None, None,
                   confidence_weight)
