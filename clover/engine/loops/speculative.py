"""Exact mode's acceptance rule: verify deterministic drafts against the target's sampled choice, so a sampled
request's output is distributed exactly as token-by-token sampling, and with a seed it is block size 1's text.

Exact mode reads, per row, the last decided token and `k` drafts `d_1..d_k` causally; the logits at causal
position `i` (0-based) predict the token after `d_1..d_i`, so position `i - 1` judges draft `d_i` and position `k`
gives the bonus token. `p_i` is the *processed* target distribution there: what `BatchSampler` draws from (banned
ids, repetition penalty, DRY, temperature, top-k, top-p; `target_probs`). The penalties read a history per position:
position `i` is only used if `d_1..d_i` are accepted, so it is judged after the committed tokens and `d_1..d_i`,
as block size 1 would judge it (`BatchSampler`'s `extension`).

The rule. With `t` the answer position of causal position 0 (the tokens the request has decided so far), the
choice at position `i` is `s_i = argmax_x p_i(x) / E_{t+i}(x)`: the exponential race with the noise keyed by the
request's seed and the answer position `t + i` (clover.engine.noise), the very draw block size 1 makes there. Draft
`d_i` is accepted while `d_i == s_{i-1}`, and the row commits the accepted drafts, then `s_a` at the first
difference (or the bonus `s_k`): it commits `s_0 .. s_a`. So every committed token is a function of the seed, its
answer position and the distribution there, whatever was drafted: block size 1's token wherever the text before it
is the same, which makes a seeded request repeatable across draft policies, batches and the machine's timing.

Distribution. The noise at an answer position is independent of the noise at every other one, and `p` at a
position depends only on the tokens before it, so the committed tokens are distributed as sampling one token at a
time. It is speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for point-mass drafts `q = δ_d`, in
another coupling: `d` is accepted with probability `P(s = d) = p(d)`, which is `min(1, p(d) / q(d))`, and a
rejection gives `s` given `s != d`, i.e. `p` without `d` renormalised, the residual `max(p - q, 0)`. The acceptance
rate is the classic rule's.

A greedy row's choice is the argmax of the model's logits: accept while a draft equals it, then commit it, with no
random numbers. A sampled row computes noise only at the positions it reaches (accepted drafts + 1 per forward,
one per committed token as at block size 1), one column at a time over the rows still going.
"""

from __future__ import annotations

from typing import Sequence

import torch

from clover.engine.sampling import BatchSampler


def target_probs(sampler: BatchSampler, logits: torch.Tensor, drafts: list[list[int]] | None = None) -> torch.Tensor:
    """`logits` `[N, T, V]` -> the processed target distribution `[N, T, V]` (fp32): for a sampled row what
    `BatchSampler` draws from, for a greedy row the one-hot argmax; position `i` of row `r` after `drafts[r][:i]`.
    Consumes `logits` as the sampler does."""
    extension = None if drafts is None else [(0, d) for d in drafts]
    return _processed(sampler, sampler.model_logits(logits, extension))


def verify(sampler: BatchSampler, logits: torch.Tensor, drafts: torch.Tensor, k: torch.Tensor,
           positions: Sequence[int] | None = None, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule for a batch of point-mass drafts (module docstring).

    `sampler`: the batch's rows (params, seeds, banned ids), in row order. `logits` `[N, K + 1, V]`: the target
    logits at the row's causal positions (consumed, as by the sampler). `drafts` `[N, K]` (int): the drafts; only
    each row's first `k` count, the rest may hold anything. `k` `[N]` (int): real drafts per row, in `[0, K]`.
    `positions` `[N]`: the answer position of each row's causal position 0, i.e. the tokens it has decided so far
    (None: 0), which keys a sampled row's noise. `check=False` skips the checks of these shapes and values (a
    caller that built them itself, once a forward: exact mode's loop).

    Returns `accepted` `[N]` (long, `0..k`) and `tokens` `[N, K + 1]` (long): row `r` commits
    `tokens[r, : accepted[r] + 1]` (the accepted drafts, then the row's choice at the first difference or the bonus
    token after the last draft); the columns after are -1.
    """
    if check:
        _check(sampler, logits, drafts, k, positions)
    drafts, k = drafts.long(), k.long()
    x = sampler.model_logits(logits, _extension(sampler, drafts, k))
    choice = x.max(dim=-1).indices  # greedy rows' choice (the first maximum), faster than argmax on a CPU
    if not sampler.all_greedy:
        choice = _sampled_choices(sampler, x, choice, drafts, k, positions)
    return _accept(choice.tolist(), drafts, k)


def _sampled_choices(sampler: BatchSampler, x: torch.Tensor, choice: torch.Tensor, drafts: torch.Tensor,
                     k: torch.Tensor, positions: Sequence[int] | None) -> torch.Tensor:
    """`choice` `[N, K + 1]` with each sampled row's draws at the positions it reaches: column `j` is drawn for the
    rows whose drafts before it were all accepted (and `j <= k`), keyed by answer position `positions[r] + j`."""
    probs = sampler.draw_probs(x)
    first = list(positions) if positions is not None else [0] * len(sampler.seeds)
    rows, counts = drafts.tolist(), k.tolist()
    going = [r for r, seed in enumerate(sampler.seeds) if seed is not None]
    for j in range(drafts.shape[1] + 1):
        if not going:
            break
        drawn = sampler.draw(probs[going, j], going, [first[r] + j for r in going])
        choice[going, j] = drawn
        going = [r for r, t in zip(going, drawn.tolist()) if j < counts[r] and rows[r][j] == t]
    return choice


def _processed(sampler: BatchSampler, x: torch.Tensor) -> torch.Tensor:
    """`model_logits` -> the processed distribution; greedy rows one-hot at the argmax of the model's logits (the
    choice `BatchSampler` and exact mode make, with no tempered or filtered softmax in between)."""
    probs = sampler.draw_probs(x)
    if any(sampler.greedy_rows):
        one_hot = torch.nn.functional.one_hot(x.argmax(dim=-1), x.shape[-1]).to(probs.dtype)
        probs = torch.where(sampler.greedy_mask[:, None, None], one_hot, probs)
    return probs


def _accept(choice: list[list[int]], drafts: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept while a draft equals the row's choice, then commit the choice: `accepted` `[N]` and `tokens`
    `[N, K + 1]` (-1 after the committed ones). On a few integers per row (the tensor ops of a vectorised rule cost
    more than the arithmetic at a batch's size)."""
    accepted, tokens = [], []
    for picks, row, n in zip(choice, drafts.tolist(), k.tolist()):
        a = 0
        while a < n and row[a] == picks[a]:
            a += 1
        accepted.append(a)
        tokens.append(row[:a] + [picks[a]] + [-1] * (len(row) - a))
    device = drafts.device
    return (torch.tensor(accepted, dtype=torch.long, device=device),
            torch.tensor(tokens, dtype=torch.long, device=device))


def _extension(sampler: BatchSampler, drafts: torch.Tensor, k: torch.Tensor) -> list[tuple[int, list[int]]] | None:
    """Each row's real drafts, the tokens its later positions read after the history (None: no penalty reads them)."""
    if not sampler.uses_history or not drafts.shape[1]:
        return None
    return [(0, row[:n]) for row, n in zip(drafts.tolist(), k.tolist())]


def _check(sampler: BatchSampler, logits: torch.Tensor, drafts: torch.Tensor, k: torch.Tensor,
           positions: Sequence[int] | None) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [N, K + 1, V], got shape {tuple(logits.shape)}")
    n, width, vocab = logits.shape
    if len(sampler.params) != n:
        raise ValueError(f"the sampler has {len(sampler.params)} rows, logits have {n}")
    if drafts.shape != (n, width - 1):
        raise ValueError(f"drafts must be [N, K] = [{n}, {width - 1}] for logits {tuple(logits.shape)}, "
                         f"got {tuple(drafts.shape)}")
    if k.shape != (n,):
        raise ValueError(f"k must be [N] = [{n}], got {tuple(k.shape)}")
    if positions is not None and len(positions) != n:
        raise ValueError(f"positions must give one answer position per row ({n}), got {len(positions)}")
    if drafts.is_floating_point() or k.is_floating_point():
        raise ValueError(f"drafts and k must be integer tensors, got {drafts.dtype} and {k.dtype}")
    if bool(((k < 0) | (k > width - 1)).any()):
        raise ValueError(f"k must be in [0, {width - 1}], got {k.tolist()}")
    real = torch.arange(width - 1, device=drafts.device)[None] < k[:, None]
    if bool(((drafts < 0) | (drafts >= vocab))[real].any()):
        raise ValueError(f"drafts must be token ids in [0, {vocab}) (within each row's first k)")
