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
block-causally: a block's first position is then the base's own next-token prediction.

`reference_block_loss` computes the diffusion term the obvious way, one forward per block
(`model(clean[:start], B, prefix_len=P, query_ids=noised block)`, as decoding runs it); the tests prove the
vectorised form equals it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from clover.training.config import NoiseConfig

RATE_FLOOR = 1e-3  # inverse-rate weights are 1 / max(r, RATE_FLOOR)

# A reference for the KL term: (input_ids, attention_mask, logits_to_keep) -> causal logits, no grad.
ReferenceFn = Callable[[torch.Tensor, torch.Tensor | None, int], torch.Tensor]


# -- batches ---------------------------------------------------------------------------------------------------
@dataclass
class Batch:
    """Documents laid out for the objective.

    `input_ids` `[N, P + R]`: prompts left-padded to a common `P` (attention_mask False there), then responses
    padded with `[MASK]` to `R`, a multiple of the block size. `loss_mask` `[N, R]`: supervised response
    positions. `num_blocks[n]`: blocks of row `n`'s own response (its noise depends only on that and its seed).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    prompt_len: int
    num_blocks: list[int]
    seeds: list[int | None] = field(default_factory=list)
    num_tokens: int = 0  # real tokens (prompt + response, no padding)

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_len(self) -> int:
        return self.loss_mask.shape[1]

    @property
    def response(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len:]

    @property
    def padded(self) -> bool:
        return not bool(self.attention_mask.all())

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device),
                     self.prompt_len, list(self.num_blocks), list(self.seeds), self.num_tokens)


def _as_document(doc: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`(input_ids, loss_mask, prompt tokens)`: the prompt is the first `max(prompt_len, 1)` tokens (a document with
    no prompt still needs one token of context to predict the first response token from), and a 1-token
    document has no response."""
    if isinstance(doc, dict):
        ids, mask, prompt_len = doc["input_ids"], doc.get("loss_mask"), doc.get("prompt_len", 0)
    else:
        ids, mask, prompt_len = doc
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else torch.as_tensor(mask).flatten().bool()
    if mask.shape != ids.shape:
        raise ValueError(f"document has {ids.numel()} tokens but {mask.numel()} loss-mask entries")
    return ids, mask, min(max(int(prompt_len), 1), max(ids.numel() - 1, 1))


def document_shape(doc: Any) -> tuple[int, int]:
    """(prompt, response) tokens of a document as `collate` splits it, before `max_seq_len` truncation."""
    ids, _, prompt_len = _as_document(doc)
    return prompt_len, ids.numel() - prompt_len


def collate(documents: Sequence[Any], block_size: int, *, mask_token_id: int, eos_token_id: int | None = None,
            pad_target: str = "none", max_seq_len: int | None = None,
            seeds: Sequence[int | None] | None = None) -> Batch:
    """Lay out `(input_ids, loss_mask, prompt_len)` documents (e.g. `clover.training.data.Document`) as a Batch.

    * The prompt is split off as `_as_document` says; its loss mask is ignored.
    * `max_seq_len` bounds prompt + response before block padding (so a row may exceed it by up to
      `block_size - 1` pad positions): the response is truncated; a prompt that leaves no room for a block keeps
      only its last `max_seq_len - 1` tokens.
    * Each response is padded to a multiple of `block_size`: with `[MASK]`, never trained (`pad_target="none"`),
      or with EOS, trained (`"eos"`: the model learns to fill a finished block with EOS). Rows are then padded
      with `[MASK]` blocks (never trained, and invisible to earlier blocks) to the longest response.
    """
    if not documents:
        raise ValueError("collate needs at least one document")
    if pad_target == "eos" and eos_token_id is None:
        raise ValueError("pad_target='eos' needs an eos_token_id")
    prompts, responses, masks, nbs = [], [], [], []
    real = 0
    for doc in documents:
        ids, mask, pl = _as_document(doc)
        if ids.numel() == 0:
            raise ValueError("empty document")
        prompt, response, rmask = ids[:pl], ids[pl:], mask[pl:]
        if max_seq_len is not None:
            if pl > max_seq_len - 1:
                prompt = prompt[-(max_seq_len - 1):]
            room = max(max_seq_len - prompt.numel(), 1)
            response, rmask = response[:room], rmask[:room]
        real += prompt.numel() + response.numel()
        nb = math.ceil(response.numel() / block_size)
        pad = nb * block_size - response.numel()
        fill, train = (eos_token_id, True) if pad_target == "eos" else (mask_token_id, False)
        response = torch.cat([response, torch.full((pad,), fill, dtype=torch.long)])
        rmask = torch.cat([rmask, torch.full((pad,), train, dtype=torch.bool)])
        prompts.append(prompt)
        responses.append(response)
        masks.append(rmask)
        nbs.append(nb)
    p = max(x.numel() for x in prompts)
    r = max(max(nbs), 1) * block_size
    n = len(documents)
    input_ids = torch.full((n, p + r), mask_token_id, dtype=torch.long)
    attention = torch.zeros(n, p + r, dtype=torch.bool)
    loss_mask = torch.zeros(n, r, dtype=torch.bool)
    for i, (prompt, response, rmask) in enumerate(zip(prompts, responses, masks)):
        input_ids[i, p - prompt.numel(): p] = prompt
        input_ids[i, p: p + response.numel()] = response
        attention[i, p - prompt.numel():] = True
        loss_mask[i, : rmask.numel()] = rmask
    seeds = list(seeds) if seeds is not None else [None] * n
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} documents")
    return Batch(input_ids, attention, loss_mask, p, nbs, seeds, real)


# -- noise -----------------------------------------------------------------------------------------------------
@dataclass
class Noise:
    """Masks of the noised copies: `mask` `[copies * N, R]` (copy-major rows), `rate` `[copies * N, nb]`."""

    mask: torch.Tensor
    rate: torch.Tensor
    copies: int
    weighting: str = "none"


def mask_rate(t: torch.Tensor, schedule: str) -> torch.Tensor:
    if schedule == "linear":
        return t
    if schedule == "cosine":
        return 1.0 - torch.cos(0.5 * math.pi * t)
    raise ValueError(f"unknown noise schedule {schedule!r}")


def sample_noise(batch: Batch, block_size: int, config: NoiseConfig) -> Noise:
    """Draw each row's masks from its own seed (so a document's noise does not depend on the batch it is in).

    Per block: `t ~ U(t_min, t_max)`, rate `r = schedule(t)`; "bernoulli" masks each supervised position with
    probability `r`, "exact" masks `ceil(r n)` of the block's `n` supervised positions (at least one). The
    complementary copy masks exactly the supervised positions the first one leaves, with rate `1 - r` (or the
    realised fraction for "exact").
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
        if config.sampling == "bernoulli":
            m = (u < r[:, None]) & sup
            rate[i, :nb], comp_rate[i, :nb] = r, 1.0 - r
        else:
            n_sup = sup.sum(1)
            k = torch.minimum(torch.ceil(r * n_sup).long().clamp(min=1), n_sup)
            order = torch.where(sup, u, torch.full_like(u, 2.0)).argsort(dim=1).argsort(dim=1)  # rank of u
            m = (order < k[:, None]) & sup
            frac = k.float() / n_sup.clamp(min=1).float()
            rate[i, :nb], comp_rate[i, :nb] = frac, 1.0 - frac
        mask[i, : nb * block_size] = m.flatten()
    if not config.complementary:
        return Noise(mask, rate, 1, config.weighting)
    comp = loss_mask & ~mask
    return Noise(torch.cat([mask, comp]), torch.cat([rate, comp_rate]), 2, config.weighting)


def loss_denominators(batch: Batch, noise: Noise) -> dict[str, float]:
    """Normalisers of the loss terms, known before the forward (so accumulation / DDP can use global ones)."""
    supervised = float(batch.loss_mask.sum())
    if noise.weighting == "inverse_rate":
        diffusion = supervised * noise.copies
    else:
        diffusion = float(noise.mask.sum())
    return {"diffusion": diffusion, "ar": supervised, "masked": float(noise.mask.sum())}


# -- the loss --------------------------------------------------------------------------------------------------
def _token_weights(noise: Noise, rows: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor | None:
    if noise.weighting == "inverse_rate":
        rate = noise.rate.to(pos.device)[rows, torch.div(pos, block_size, rounding_mode="floor")]
        return 1.0 / rate.clamp(min=RATE_FLOOR)
    if noise.weighting != "none":
        raise ValueError(f"unknown loss weighting {noise.weighting!r}")
    return None


def _masked_terms(logits: torch.Tensor, targets: torch.Tensor, first: torch.Tensor,
                  weights: torch.Tensor | None, confidence: bool = False) -> dict[str, torch.Tensor]:
    logp = logits.float().log_softmax(-1)
    ce = F.nll_loss(logp, targets, reduction="none")
    weighted = ce if weights is None else ce * weights
    right = logits.detach().argmax(-1) == targets
    correct = right.sum()
    terms = {}
    if confidence:  # entropy -sum p log p where the argmax is already right (CAP / certainty forcing)
        terms["confidence_sum"] = -(logp[right].exp() * logp[right]).sum()
    return terms | {
        "diffusion_sum": weighted.sum(),
        "ce_sum": ce.detach().sum(),
        "first_sum": ce.detach()[first].sum(),
        "first_count": first.sum(),
        "masked": torch.tensor(float(ce.numel()), device=ce.device),
        "correct": correct,
    }


def _finish(terms: dict[str, torch.Tensor], den: dict[str, float], ar_weight: float, kl_weight: float,
            ar_sum: torch.Tensor | None, kl_sum: torch.Tensor | None,
            confidence_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    loss = terms["diffusion_sum"] / max(den["diffusion"], 1.0)
    if "confidence_sum" in terms:
        loss = loss + confidence_weight * terms["confidence_sum"] / max(den["masked"], 1.0)
    masked = float(terms["masked"])
    first = float(terms["first_count"])
    metrics = {
        "diffusion_loss": float(loss.detach()),
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
    if "confidence_sum" in terms:  # mean entropy over the correctly predicted masked tokens
        metrics["confidence_sum"] = float(terms["confidence_sum"].detach())
        metrics["confident_entropy"] = metrics["confidence_sum"] / max(float(terms["correct"]), 1.0)
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


def bd3_loss(model: torch.nn.Module, batch: Batch, block_size: int, noise: Noise | NoiseConfig, *,
             mask_token_id: int | None = None, ar_weight: float = 0.0, kl_weight: float = 0.0,
             confidence_weight: float = 0.0, reference: ReferenceFn | None = None,
             denominators: dict[str, float] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """BD3-LM loss of `batch` in one vectorised forward (+ one causal forward for the AR / KL terms).

    `noise`: a `Noise` (fixed masks) or a `NoiseConfig` (drawn with `sample_noise` from the rows' seeds).
    `denominators`: the normalisers (`loss_denominators`); the trainer passes global ones so that gradient
    accumulation and data parallelism give the gradient of one big batch. Returns `(loss, metrics)`; the
    metrics hold means for logging and raw sums for aggregation.
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
    den = denominators or loss_denominators(batch, noise)
    device = batch.input_ids.device
    c = noise.copies
    ids = batch.input_ids.repeat(c, 1)
    attention = batch.attention_mask.repeat(c, 1) if batch.padded else None
    mask = noise.mask.to(device)
    response = ids[:, p:]
    query = torch.where(mask, torch.full_like(response, mask_id), response)
    # Logits only where a masked token is predicted: a block's first position from the clean output at
    # P + pos - 1, the others from the noised block's output at pos - 1 (the query stream, which follows the
    # P + R clean positions).
    rows, pos = mask.nonzero(as_tuple=True)
    first = pos % block_size == 0
    length = ids.shape[1]
    column = torch.where(first, p + pos - 1, length + pos - 1)
    order = (rows * (length + r) + column).argsort()  # the model returns selected logits in row-major order
    rows, pos, first, column = rows[order], pos[order], first[order], column[order]
    at = torch.zeros(ids.shape[0], length + r, dtype=torch.bool, device=device)
    at[rows, column] = True
    logits = model(ids, block_size, prefix_len=p, attention_mask=attention, query_ids=query, query_start=p,
                   logits_at=at).logits
    terms = _masked_terms(logits, response[rows, pos], first, _token_weights(noise, rows, pos, block_size),
                          confidence=confidence_weight > 0)

    ar_sum = kl_sum = None
    if ar_weight or kl_weight:
        ar_sum, kl_sum = _causal_terms(model, batch, kl_weight, reference)
    return _finish(terms, den, ar_weight, kl_weight, ar_sum, kl_sum, confidence_weight)


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
    pieces: dict[str, list[torch.Tensor]] = {}
    for c in range(noise.copies):
        rows_c = slice(c * n, (c + 1) * n)
        mask_c = noise.mask[rows_c].to(batch.input_ids.device)
        for j in range(r // b):
            start = p + j * b
            block_mask = mask_c[:, j * b: (j + 1) * b]
            block = batch.input_ids[:, start: start + b]
            noised = torch.where(block_mask, torch.full_like(block, mask_id), block)
            attention = batch.attention_mask[:, :start] if batch.padded else None
            out = model(batch.input_ids[:, :start], b, prefix_len=p, attention_mask=attention, query_ids=noised)
            shifted = torch.cat([out.logits[:, -1:], out.query_logits[:, :-1]], dim=1)  # position i from i - 1
            rows, off = block_mask.nonzero(as_tuple=True)
            logits = shifted[rows, off]
            targets = batch.input_ids[rows, start + off]
            pos = j * b + off
            weights = _token_weights(noise, rows + c * n, pos, b)
            terms = _masked_terms(logits, targets, off == 0, weights, confidence=confidence_weight > 0)
            for k, v in terms.items():
                pieces.setdefault(k, []).append(v)
    total = {k: torch.stack([torch.as_tensor(x, dtype=torch.float, device=v[0].device) for x in v]).sum()
             for k, v in pieces.items()}
    return _finish(total, loss_denominators(batch, noise), 0.0, 0.0, None, None, confidence_weight)
