"""Speculative sampling's acceptance rule for exact mode: verify deterministic drafts against the target's sampled
distribution, so a sampled request's output is distributed exactly as token-by-token sampling.

Exact mode reads, per row, the last decided token and `k` drafts `d_1..d_k` causally; the logits at causal
position `i` (0-based) predict the token after `d_1..d_i`, so position `i - 1` judges draft `d_i` and position `k`
gives the bonus token. `p_i` is the *processed* target distribution there: what `BatchSampler` draws from (banned
ids, repetition penalty, DRY, temperature, top-k, top-p; `target_probs`). The penalties read a history per position:
position `i` is only used if `d_1..d_i` are accepted, so it is judged after the committed tokens and `d_1..d_i`,
as block size 1 would judge it (`BatchSampler`'s `extension`).

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023) draws `x ~ q`, accepts it with probability
`min(1, p(x) / q(x))` and, on rejection, draws from the residual `normalize(max(p - q, 0))`; the result is a draw
from `p`. Our drafts are the drafter's argmax, a point mass `q = δ_d`, so:

* the acceptance probability is `min(1, p(d) / 1) = p(d)`;
* the residual is `max(p(x) - δ_d(x), 0)`: `p(x)` for `x != d` and `max(p(d) - 1, 0) = 0` at `d`, i.e. `p` with `d`
  removed, normalised by `1 - p(d)`.

Check: `P(d) = p(d)`, and for `x != d`, `P(x) = (1 - p(d)) * p(x) / (1 - p(d)) = p(x)`. Position `i`'s logits read
exactly the prefix committed so far (the accepted drafts), so by induction over the positions the committed
tokens, the bonus token after `k` acceptances included, are distributed as sampling one token at a time.

A greedy row's `p` is the one-hot argmax `c`: `p(d)` is 1 when `d == c` and 0 otherwise, and the residual of a
one-hot `c` without `d != c` is `c` again, so the rule becomes exact mode's greedy rule (accept while equal to the
argmax, then commit the argmax), computed without random numbers.

Random numbers: each sampled row draws from its own generator (the `BatchSampler`'s), always `k` uniforms then
one exponential race over the vocabulary (`BatchSampler.draw`), whatever is accepted; so its result and its
stream do not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from clover.engine.sampling import BatchSampler


def target_probs(sampler: BatchSampler, logits: torch.Tensor, drafts: list[list[int]] | None = None) -> torch.Tensor:
    """`logits` `[N, T, V]` -> the processed target distribution `[N, T, V]` (fp32): for a sampled row what
    `BatchSampler` draws from, for a greedy row the one-hot argmax; position `i` of row `r` after `drafts[r][:i]`.
    Consumes `logits` as the sampler does."""
    extension = None if drafts is None else [(0, d) for d in drafts]
    return _processed(sampler, sampler.model_logits(logits, extension))


def verify(sampler: BatchSampler, logits: torch.Tensor, drafts: torch.Tensor,
           k: torch.Tensor, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of a batch of point-mass drafts (module docstring).

    `sampler`: the batch's rows (params, generators, banned ids), in row order. `logits` `[N, K + 1, V]`: the
    target logits at the row's causal positions (consumed, as by the sampler). `drafts` `[N, K]` (int): the
    drafts; only each row's first `k` count, the rest may hold anything. `k` `[N]` (int): real drafts per row, in
    `[0, K]`. `check=False` skips the checks of these shapes and values (a caller that built them itself, once a
    forward: exact mode's loop).

    Returns `accepted` `[N]` (long, `0..k`) and `tokens` `[N, K + 1]` (long): row `r` commits
    `tokens[r, : accepted[r] + 1]` (the accepted drafts, then the residual draw at the first rejection or the bonus
    token after the last draft); the columns after are -1.
    """
    if check:
        _check(sampler, logits, drafts, k)
    drafts, k = drafts.long(), k.long()
    x = sampler.model_logits(logits, _extension(sampler, drafts, k))
    if sampler.all_greedy:  # no [N, K + 1, V] probabilities: the argmax is the whole distribution
        return _verify_greedy(x, drafts, k)

    real = torch.arange(drafts.shape[1], device=drafts.device)[None] < k[:, None]
    probs = _processed(sampler, x)
    judged = drafts.masked_fill(~real, 0)  # padding may hold any id (a mask id, -1): gather a valid one
    p_draft = probs[:, :-1].gather(-1, judged[..., None])[..., 0]  # [N, K]: p_i(d_i)
    # greedy rows: u = 0 accepts exactly when p(d) = 1, i.e. d is the argmax; sampled rows: u ~ U[0, 1)
    uniforms = _uniforms(sampler.generators, k, p_draft)
    accepted = _accepted(uniforms < p_draft, real)
    final = _final_distribution(probs, drafts, real, accepted)
    return accepted, _committed(drafts, accepted, _draw(sampler.generators, final))


def _processed(sampler: BatchSampler, x: torch.Tensor) -> torch.Tensor:
    """`model_logits` -> the processed distribution; greedy rows one-hot at the argmax of the model's logits (the
    choice `BatchSampler` and exact mode make, with no tempered or filtered softmax in between)."""
    probs = sampler.draw_probs(x)
    if any(sampler.greedy_rows):
        one_hot = torch.nn.functional.one_hot(x.argmax(dim=-1), x.shape[-1]).to(probs.dtype)
        probs = torch.where(sampler.greedy_mask[:, None, None], one_hot, probs)
    return probs


def _verify_greedy(x: torch.Tensor, drafts: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify` of greedy rows: accept while a draft is the argmax, then commit the argmax. On a few integers per
    row (the tensor ops of the general rule cost more than the arithmetic at a batch's size)."""
    best = x.max(dim=-1).indices.tolist()  # argmax's choice (the first maximum), faster than argmax on a CPU
    accepted, tokens = [], []
    for choice, row, n in zip(best, drafts.tolist(), k.tolist()):
        a = 0
        while a < n and row[a] == choice[a]:
            a += 1
        accepted.append(a)
        tokens.append(row[:a] + [choice[a]] + [-1] * (len(row) - a))
    device = drafts.device
    return (torch.tensor(accepted, dtype=torch.long, device=device),
            torch.tensor(tokens, dtype=torch.long, device=device))


def _uniforms(generators: list[torch.Generator | None], k: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`[N, K]` acceptance uniforms: a sampled row's first `k` from its generator, everything else 0."""
    u = torch.zeros_like(like)
    for row, (gen, n) in enumerate(zip(generators, k.tolist())):
        if gen is not None and n:
            u[row, :n] = torch.rand(n, generator=gen, device=u.device)
    return u


def _accepted(accept: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """`[N]`: the drafts accepted before the first rejection (or the first padding column)."""
    return (accept & real).int().cumprod(dim=1).sum(dim=1).long()


def _final_distribution(probs: torch.Tensor, drafts: torch.Tensor, real: torch.Tensor,
                        accepted: torch.Tensor) -> torch.Tensor:
    """`[N, V]`, unnormalised: where the row stopped, the residual (`p` without the rejected draft) or, after
    accepting every draft, the bonus position's `p`."""
    rows = torch.arange(probs.shape[0], device=probs.device)
    final = probs[rows, accepted]
    # the rejected draft per row, -1 (nothing to remove) for the bonus: column `accepted` of the padded drafts
    rejected = torch.nn.functional.pad(drafts.masked_fill(~real, -1), (0, 1), value=-1).gather(1, accepted[:, None])
    vocab = torch.arange(probs.shape[-1], device=probs.device)
    return final.masked_fill(vocab[None] == rejected, 0.0)


def _draw(generators: list[torch.Generator | None], final: torch.Tensor) -> torch.Tensor:
    """`[N]`: one token per row from `final` `[N, V]`; greedy rows (one-hot) take the argmax and draw nothing."""
    tokens = final.argmax(dim=-1)
    for row, gen in enumerate(generators):
        if gen is not None:
            tokens[row] = BatchSampler.draw(final[row], gen)
    return tokens


def _committed(drafts: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """`[N, K + 1]`: the accepted drafts, then `last`, then -1."""
    cols = torch.arange(drafts.shape[1] + 1, device=drafts.device)[None]
    tokens = torch.nn.functional.pad(drafts, (0, 1), value=-1).masked_fill(cols >= accepted[:, None], -1)
    return tokens.scatter(1, accepted[:, None], last[:, None])


def _extension(sampler: BatchSampler, drafts: torch.Tensor, k: torch.Tensor) -> list[tuple[int, list[int]]] | None:
    """Each row's real drafts, the tokens its later positions read after the history (None: no penalty reads them)."""
    if not sampler.uses_history or not drafts.shape[1]:
        return None
    return [(0, row[:n]) for row, n in zip(drafts.tolist(), k.tolist())]


def _check(sampler: BatchSampler, logits: torch.Tensor, drafts: torch.Tensor, k: torch.Tensor) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [N, K + 1, V], got shape {tuple(logits.shape)}")
    n, positions, vocab = logits.shape
    if len(sampler.params) != n:
        raise ValueError(f"the sampler has {len(sampler.params)} rows, logits have {n}")
    if drafts.shape != (n, positions - 1):
        raise ValueError(f"drafts must be [N, K] = [{n}, {positions - 1}] for logits {tuple(logits.shape)}, "
                         f"got {tuple(drafts.shape)}")
    if k.shape != (n,):
        raise ValueError(f"k must be [N] = [{n}], got {tuple(k.shape)}")
    if drafts.is_floating_point() or k.is_floating_point():
        raise ValueError(f"drafts and k must be integer tensors, got {drafts.dtype} and {k.dtype}")
    if bool(((k < 0) | (k > positions - 1)).any()):
        raise ValueError(f"k must be in [0, {positions - 1}], got {k.tolist()}")
    real = torch.arange(positions - 1, device=drafts.device)[None] < k[:, None]
    if bool(((drafts < 0) | (drafts >= vocab))[real].any()):
        raise ValueError(f"drafts must be token ids in [0, {vocab}) (within each row's first k)")
