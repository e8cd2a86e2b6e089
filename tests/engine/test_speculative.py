"""Speculative verification (clover.engine.loops.speculative): the greedy rule, the distribution of the committed
tokens, batch invariance, and errors."""

from __future__ import annotations

import pytest
import torch

from clover.engine import SamplingParams
from clover.engine.sampling import BatchSampler
from clover.engine.loops.speculative import target_probs, verify

V = 6
BANNED = [5]  # stands for the mask id: never committed, and a draft of it is always rejected


def greedy_rule(logits: torch.Tensor, drafts: torch.Tensor, k: torch.Tensor,
                banned: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact mode's greedy rule, written out: accept `d_i` while it is the causal argmax, then commit the argmax."""
    x = logits.clone()
    x[..., banned] = float("-inf")
    best = x.argmax(-1)
    accepted = torch.zeros(len(k), dtype=torch.long)
    tokens = torch.full(best.shape, -1)
    for r in range(len(k)):
        a = 0
        while a < k[r] and drafts[r, a] == best[r, a]:
            a += 1
        accepted[r] = a
        tokens[r, :a] = drafts[r, :a]
        tokens[r, a] = best[r, a]
    return accepted, tokens


def greedy_case(n: int, width: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits `[n, width + 1, vocab]`, drafts that follow the argmax up to a row's own break point, and `k`."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, width + 1, vocab, generator=g)
    logits[0, 0, vocab - 1] = 50.0  # a banned id would win
    drafts = logits[:, :width, : vocab - 1].argmax(-1)
    wrong = torch.randint(0, width + 1, (n,), generator=g)  # width: every draft right
    for r in range(n):
        if wrong[r] < width:
            drafts[r, wrong[r]] = (drafts[r, wrong[r]] + 1) % (vocab - 1)
    k = torch.randint(0, width + 1, (n,), generator=g)
    drafts = drafts.masked_fill(torch.arange(width)[None] >= k[:, None], -1)  # padding: any id
    return logits, drafts, k


def test_greedy_rows_follow_the_greedy_rule_and_draw_nothing() -> None:
    logits, drafts, k = greedy_case(n=12, width=4, vocab=20, seed=0)
    expected = greedy_rule(logits, drafts, k, banned=[19])
    assert (expected[0] == k).any() and (expected[0] < k).any()  # the case has bonus tokens and rejections
    state = torch.get_rng_state()
    got = verify(BatchSampler([SamplingParams()] * 12, 20, banned=[19]), logits.clone(), drafts, k)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    # in a batch with sampled rows (the one-hot path) the greedy rows still give the greedy rule
    params = [SamplingParams() if r % 2 else SamplingParams(temperature=1.0, top_k=3, seed=r) for r in range(12)]
    mixed = verify(BatchSampler(params, 20, banned=[19]), logits.clone(), drafts, k)
    assert torch.equal(mixed[0][1::2], expected[0][1::2]) and torch.equal(mixed[1][1::2], expected[1][1::2])
    assert torch.equal(torch.get_rng_state(), state)  # seeded rows use their own keyed noise, greedy ones none


def test_committed_tokens_layout() -> None:
    logits, drafts, k = greedy_case(n=12, width=4, vocab=20, seed=1)
    params = [SamplingParams(temperature=1.0, seed=r) for r in range(12)]
    accepted, tokens = verify(BatchSampler(params, 20, banned=[19]), logits, drafts, k)
    assert tokens.dtype == torch.long and tokens.shape == (12, 5)
    assert bool(((accepted >= 0) & (accepted <= k)).all())
    for r in range(12):
        a = int(accepted[r])
        assert torch.equal(tokens[r, :a], drafts[r, :a])
        assert 0 <= tokens[r, a] < 19 and (tokens[r, a + 1:] == -1).all()
        if a < k[r]:
            assert tokens[r, a] != drafts[r, a]  # the residual never gives back the rejected draft


# -- the distribution of the committed tokens ---------------------------------------------------------------

def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The processed distribution over `[V]`, written independently of BatchSampler: banned ids, temperature,
    top-k, then the smallest set of likeliest tokens whose mass reaches top_p, renormalised."""
    x = logits.clone().double()
    x[BANNED] = float("-inf")
    x = x / p.temperature
    order = x.argsort(descending=True).tolist()
    keep = order[: p.top_k or V]
    probs = torch.softmax(x[keep], dim=0).tolist()
    mass, kept = 0.0, []
    for tok, q in zip(keep, probs):
        if mass >= p.top_p:
            break
        kept.append(tok)
        mass += q
    out = torch.zeros(V, dtype=torch.double)
    out[kept] = torch.softmax(x[kept], dim=0)
    return out


def toy_model(seed: int) -> list[torch.Tensor]:
    """A fixed causal model over a 3-position chain: `tables[j][ctx]` are the logits after the prefix `ctx`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*[V] * (j + 1), generator=g) * 1.5 for j in range(3)]


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=probs.numel()).double() / len(samples)
    return 0.5 * float((freq - probs.flatten()).abs().sum())


def tv_bound(probs: torch.Tensor, n: int) -> float:
    """Twice the bound on the expected TV of n draws: E|f - p| <= sqrt(p / n) per cell, summed and halved."""
    return float(probs.sqrt().sum()) / n ** 0.5


N_TRIALS = 20000
CASES = [  # (params, drafts d1 d2 after the empty prefix, draft d3 after (t1,)); some drafts bad on purpose
    (SamplingParams(temperature=1.0), (0, 1), 2),
    (SamplingParams(temperature=0.6, top_k=3), (4, 2), 0),
    (SamplingParams(temperature=1.5, top_p=0.8), (1, 5), 3),  # d2 banned: always rejected
    (SamplingParams(temperature=1.0, top_k=4, top_p=0.7), (2, 0), 1),
]


@pytest.mark.parametrize("params, first, third", CASES)
def test_committed_tokens_follow_the_processed_target_distribution(params: SamplingParams, first: tuple[int, int],
                                                                   third: int) -> None:
    """Many seeded trials (one per row) of decoding two tokens: one forward verifies d1 d2 after the empty
    prefix; where it commits a single token t1, a second verifies d3 after t1. The first token and the pair
    (t1, t2) must follow p(t1) and p(t1) p(t2 | t1) under the processed distribution, whatever the drafts."""
    tables = toy_model(seed=7)
    d1, d2 = first
    sampler = BatchSampler([SamplingParams(params.temperature, params.top_p, params.top_k, seed=s)
                            for s in range(N_TRIALS)], V, banned=BANNED)
    logits = torch.stack([tables[0], tables[1][d1], tables[2][d1, d2]])[None].expand(N_TRIALS, -1, -1)
    drafts = torch.tensor([[d1, d2]]).expand(N_TRIALS, -1)
    accepted, tokens = verify(sampler, logits.clone(), drafts, torch.full((N_TRIALS,), 2))
    t1 = tokens[:, 0]
    again = torch.stack([tables[1][t1], tables[2][t1, third]], dim=1)
    _, second = verify(sampler, again, torch.full((N_TRIALS, 1), third), torch.ones(N_TRIALS, dtype=torch.long),
                       positions=[1] * N_TRIALS)  # the second forward decides the answer's second token
    t2 = torch.where(accepted >= 1, tokens[:, 1], second[:, 0])

    p1 = reference_probs(tables[0], params)
    joint = p1[:, None] * torch.stack([reference_probs(tables[1][t], params) for t in range(V)])
    for samples, probs in [(t1, p1), (t1 * V + t2, joint)]:
        assert not (probs.flatten()[samples] == 0).any()  # banned and filtered tokens never come out
        assert total_variation(samples, probs) < tv_bound(probs, N_TRIALS)
    # after both drafts are accepted, the bonus token follows p(. | d1 d2)
    bonus = tokens[accepted == 2, 2]
    if len(bonus) >= 500:
        probs = reference_probs(tables[2][d1, d2], params)
        assert total_variation(bonus, probs) < tv_bound(probs, len(bonus))


def _decode_chain(tables: list[torch.Tensor], params: SamplingParams, drafts_after) -> tuple[list[int], int]:
    """The toy model's three tokens and the forwards they took, each forward verifying `drafts_after(prefix)` (at
    most what the chain has room for) at the prefix's answer position; a fresh sampler per forward, as a row's
    seed is all it carries."""
    got: list[int] = []
    forwards = 0
    while len(got) < 3:
        d = list(drafts_after(got))[: 2 - len(got)]
        logits = torch.stack([tables[len(got) + i][tuple(got + d[:i])] for i in range(len(d) + 1)])[None]
        accepted, tokens = verify(BatchSampler([params], V, banned=BANNED), logits.clone(),
                                  torch.tensor([d], dtype=torch.long).view(1, len(d)), torch.tensor([len(d)]),
                                  [len(got)])
        got += tokens[0, : int(accepted) + 1].tolist()
        forwards += 1
    return got, forwards


@pytest.mark.parametrize("params", [p for p, _, _ in CASES])
def test_a_seed_commits_block_size_1s_tokens_whatever_the_drafts(params: SamplingParams) -> None:
    """The noise is keyed by answer position: a seeded row commits the tokens that sampling one token at a time
    with that seed gives, whether its drafts are absent, right, wrong or banned; they change how many tokens a
    forward commits, never which."""
    tables = toy_model(seed=7)
    texts = set()
    for seed in range(150):
        p = SamplingParams(params.temperature, params.top_p, params.top_k, seed=seed)
        one, forwards = _decode_chain(tables, p, lambda prefix: [])
        assert forwards == 3
        texts.add(tuple(one))
        assert _decode_chain(tables, p, lambda prefix: one[len(prefix):]) == (one, 1)  # right: all in one forward
        for drafts in (lambda prefix: [(t + 1) % 5 for t in one[len(prefix):]],  # wrong
                       lambda prefix: [one[len(prefix)], 5],  # right, then the banned id
                       lambda prefix: [seed % 5, (seed // 5) % 5]):  # whatever
            assert _decode_chain(tables, p, drafts)[0] == one, seed
    assert len(texts) > 5  # the seeds do sample


def test_target_probs_is_what_batch_sampler_draws_from() -> None:
    tables = toy_model(seed=7)
    params = [p for p, _, _ in CASES] + [SamplingParams()]
    logits = tables[1][:len(params), None].expand(-1, 2, -1).contiguous()
    probs = target_probs(BatchSampler(params, V, banned=BANNED), logits.clone())
    for r, p in enumerate(params[:-1]):
        torch.testing.assert_close(probs[r, 0].double(), reference_probs(logits[r, 0], p), atol=1e-6, rtol=0)
    assert torch.equal(probs[-1], torch.nn.functional.one_hot(logits[-1, :, :5].argmax(-1), V).float())
    # with no drafts, verification is a plain draw: the very token BatchSampler draws with the same seed
    seeded = [SamplingParams(p.temperature, p.top_p, p.top_k, seed=3) for p in params]
    drawn, _ = BatchSampler(seeded, V, banned=BANNED)(logits[:, :1].clone())
    _, tokens = verify(BatchSampler(seeded, V, banned=BANNED), logits[:, :1].clone(),
                       torch.zeros(len(params), 0, dtype=torch.long), torch.zeros(len(params), dtype=torch.long))
    assert torch.equal(tokens, drawn)


# -- batch invariance -----------------------------------------------------------------------------------------

def test_a_row_gets_the_same_tokens_alone_or_in_a_batch() -> None:
    logits, drafts, k = greedy_case(n=6, width=4, vocab=20, seed=2)
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(),
              SamplingParams(temperature=1.2, top_k=5, seed=2),
              SamplingParams(temperature=1.0, top_p=0.6, seed=3), SamplingParams(temperature=1.0, seed=4),
              SamplingParams()]
    batch = BatchSampler(params, 20, banned=[19])
    at = [[3 * step + r for r in range(6)] for step in range(3)]  # rows at different answer positions
    together = [verify(batch, logits.clone(), drafts, k, at[step]) for step in range(3)]
    for r, p in enumerate(params):
        alone = BatchSampler([p], 20, banned=[19])
        narrow = int(k[r])  # alone, the row is as wide as its own drafts
        for step in range(3):
            accepted, tokens = verify(alone, logits[r:r + 1, : narrow + 1].clone(), drafts[r:r + 1, :narrow],
                                      k[r:r + 1], [at[step][r]])
            assert accepted.item() == together[step][0][r].item()
            assert torch.equal(tokens[0], together[step][1][r, : narrow + 1])


# -- errors ---------------------------------------------------------------------------------------------------

def test_bad_inputs_are_clear_errors() -> None:
    sampler = BatchSampler([SamplingParams(temperature=1.0, seed=0)] * 2, V, banned=BANNED)
    logits, drafts, k = torch.randn(2, 3, V), torch.zeros(2, 2, dtype=torch.long), torch.tensor([2, 1])
    for args, match in [
        ((logits[0], drafts, k), r"logits must be \[N, K \+ 1, V\]"),
        ((logits[:1], drafts[:1], k[:1]), "sampler has 2 rows, logits have 1"),
        ((logits, drafts[:, :1], k), r"drafts must be \[N, K\] = \[2, 2\]"),
        ((logits, drafts, k[:1]), r"k must be \[N\] = \[2\]"),
        ((logits, drafts.float(), k), "integer tensors"),
        ((logits, drafts, torch.tensor([3, 0])), r"k must be in \[0, 2\]"),
        ((logits, drafts, k, [0]), r"one answer position per row \(2\)"),
        ((logits, torch.tensor([[0, V], [1, -1]]), k), r"token ids in \[0, 6\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            verify(sampler, *args)
    verify(sampler, logits.clone(), torch.tensor([[0, 1], [1, -1]]), k)  # padding past k may hold anything


def test_a_penalty_judges_each_position_after_the_drafts_before_it() -> None:
    """Position `i` is used only if drafts `1..i` are accepted: its repetition penalty and DRY count them as seen,
    as sampling one token at a time would after committing them."""
    params = SamplingParams(temperature=1.0, repetition_penalty=1.5, dry_multiplier=0.8, dry_allowed_length=1,
                            dry_sequence_breakers=())
    history, drafts = [1, 2, 1], [2, 3]
    logits = torch.randn(1, 3, V)
    sampler = BatchSampler([params], V, banned=BANNED)
    sampler.observe([history])
    probs = target_probs(sampler, logits.clone(), [drafts])
    for i in range(3):
        alone = BatchSampler([params], V, banned=BANNED)
        alone.observe([history + drafts[:i]])
        assert torch.allclose(probs[0, i], target_probs(alone, logits[:, i:i + 1].clone())[0, 0], atol=1e-6)
    assert not torch.allclose(probs[0, 1], probs[0, 2])
