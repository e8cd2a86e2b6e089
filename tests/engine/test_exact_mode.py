"""Exact mode (rule `exact`): drafts verified by the causal path, rejected ones undone in the cache. Its output is
block-size-1 greedy decoding token for token — alone, in batches, streamed, through the server's scheduler with
prefix reuse — and a cache that rejected drafts is the cache of the accepted tokens alone."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest
import torch

from clover.engine import Engine, RequestOptions, SamplingParams, StreamPiece, generate, stream
from clover.engine.drafts.cost import ForwardCost
from clover.engine.decoding import ExactRule
from clover.engine.drafts.drafting import Acceptance, best_batch_verified, best_drafts, best_verified, expected_tokens
from clover.engine.loops.exact import STEP_MEMORY, CopiedDrafts, ExactBatch, ExactLoop
from clover.engine.runner import as_runner
from clover.engine.drafts.lookup import ContextLookup
from clover.model import quantize
from clover.ops import woq
from clover.serving.scheduling.prefix_cache import PrefixCache
from clover.serving.scheduling.scheduler import Scheduler
from model_helpers import PROMPTS, tiny_model

PRESETS = ["clover-tiny", "clover-tiny-dense"]
MAX_NEW = 20


@pytest.fixture(scope="module")
def models():
    return {p: tiny_model(p) for p in PRESETS}


def _greedy_b1(model, prompts, max_new=MAX_NEW, eos=()):
    return generate(model, prompts, max_new, block_size=1, eos_token_ids=list(eos)).sequences


class OracleLoop(ExactLoop):
    """Exact mode whose drafts come from a reference continuation, each draft wrong with probability `wrong`: a
    random tiny model almost never drafts its own next tokens, so this is how the tests exercise acceptance of
    several tokens per forward, partial acceptance and rows accepting different counts. Drafts are the whole
    block (not adaptive), so the forward counts are known."""

    def __init__(self, engine, reference: dict[int, list[int]], wrong: float, seed: int = 0):
        super().__init__(engine, ExactRule(adaptive=False))
        self.reference, self.wrong, self.random = reference, wrong, random.Random(seed)

    def _oracle(self, b: ExactBatch | None) -> ExactBatch | None:
        if b is None:
            return b
        width = self.engine.block_size - 1
        drafts = []
        for r, seq in enumerate(b.seqs):
            done = len(seq.generated) + int(b.n_decided[r])  # what will be emitted before the next forward
            row = (self.reference[seq.seq_id][done:] + [0] * width)[:width]
            drafts.append([(t + 1) % 200 if self.random.random() < self.wrong else t for t in row])
        b.drafts = torch.tensor(drafts)
        b.n_drafts = torch.full((len(b.seqs),), width)
        return b

    def open(self, *args, **kwargs):
        return self._oracle(super().open(*args, **kwargs))

    def step(self, b, snapshots=False):
        events, b = super().step(b, snapshots)
        return events, self._oracle(b)


def OracleDrafts(model, block_size, reference: dict[int, list[int]], wrong: float, seed: int = 0, **kw) -> Engine:
    engine = Engine(model, block_size, rule="exact", **kw)
    engine.loop = OracleLoop(engine, reference, wrong, seed)
    return engine


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("block_size", [4, 8])
def test_exact_equals_block1_greedy_alone_and_in_a_batch(models, preset, block_size):
    model = models[preset]
    ref = _greedy_b1(model, PROMPTS)
    assert generate(model, PROMPTS, MAX_NEW, block_size=block_size, rule="exact", eos_token_ids=[]).sequences == ref
    # drafting the whole block (the adaptive policy sizes drafts by the batch's cost, so a batch may draft less)
    whole = {"adaptive": False}
    batch = generate(model, PROMPTS, MAX_NEW, block_size=block_size, rule="exact", rule_options=whole,
                     eos_token_ids=[])
    assert batch.sequences == ref
    for i, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], MAX_NEW, block_size=block_size, rule="exact", rule_options=whole,
                         eos_token_ids=[])
        assert alone.sequences[0] == ref[i]
        # a batch gives each request what it gets alone: the same drafts, hence the same forwards
        assert alone.stats[0]["forward_passes"] == batch.stats[i]["forward_passes"]
    for s in batch.stats:  # every forward commits at least one token
        assert s["tokens"] == MAX_NEW and 1 <= s["forward_passes"] <= MAX_NEW and s["tokens_per_forward"] >= 1


@pytest.mark.parametrize("decoding", [dict(block_size=4, rule="exact", rule_options={"adaptive": False}),
                                      dict(block_size=1, rule="threshold")])
def test_a_step_takes_the_runners_torch_threads_and_gives_them_back(models, decoding):
    """A runner whose forwards run on their own threads (llama.cpp's) asks for `torch_threads`: the engine's
    prefills and steps, exact mode's and block size 1's alike, run torch's ops on that many (so torch's pool does not
    spin beside the runner's threads), the caller's setting comes back after each, and the tokens are the same."""
    model = models["clover-tiny-dense"]
    runner = as_runner(model)
    before = torch.get_num_threads()
    seen, forward = [], runner.forward
    runner.torch_threads = 1 if before > 1 else 2
    runner.forward = lambda *a, **k: seen.append(torch.get_num_threads()) or forward(*a, **k)
    got = generate(runner, PROMPTS[:2], MAX_NEW, eos_token_ids=[], **decoding).sequences
    # (exact mode not adaptive: no cost table measured, its forwards outside steps)
    assert got == _greedy_b1(model, PROMPTS[:2])
    assert seen and set(seen) == {runner.torch_threads}
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("matmul", ["kernel", "fp32"])
@pytest.mark.parametrize("preset", PRESETS)
def test_exact_equals_block1_on_a_packed_build_whatever_path_prompt_rows_take(preset, matmul, monkeypatch):
    """An int4 build that rounds activations twice (clover-smol's) reads prompt rows as `prompt_matmul` says (the
    fused layer's kernel, or a dequantised fp32 matmul) and decoding rows by the kernel, fused below
    `woq.DENSE_ROWS` rows. Exact mode's first forward carries query rows beside the prompt's last chunk, so it can
    have more rows than block size 1's; the prompt's rows still take block size 1's path through the linear layers,
    and the output is block size 1's, alone and in a batch."""
    monkeypatch.setenv("CLOVER_PROMPT_MATMUL", matmul)
    model = quantize(tiny_model(preset), "int4", activations="int8x2")
    # and a prompt whose first forward has more rows than `woq.DENSE_ROWS` only with the query rows beside it
    prompts = PROMPTS + [[(7 * i + 3) % 200 for i in range(woq.DENSE_ROWS - 2)]]
    ref = _greedy_b1(model, prompts)
    whole = {"adaptive": False}  # query rows in every forward, the first one too
    for i, prompt in enumerate(prompts):
        alone = generate(model, [prompt], MAX_NEW, block_size=4, rule="exact", rule_options=whole, eos_token_ids=[])
        assert alone.sequences[0] == ref[i]
    assert generate(model, prompts, MAX_NEW, block_size=4, rule="exact", rule_options=whole,
                    eos_token_ids=[]).sequences == ref


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("block_size", [4, 8])
def test_accepted_drafts_commit_several_tokens_per_forward(models, preset, block_size):
    model = models[preset]
    ref = _greedy_b1(model, PROMPTS, 40)
    reference = dict(enumerate(ref))
    # right drafts: every forward after the prefill commits B tokens (B - 1 drafts and the bonus token)
    engine = OracleDrafts(model, block_size, reference, wrong=0.0, eos_token_ids=[])
    out = [[] for _ in PROMPTS]
    forwards_before = engine.counters.forwards
    for e in engine.run(PROMPTS, 40, SamplingParams()):
        out[e.seq_id] += e.token_ids
        if e.finished:
            assert e.stats["forward_passes"] == 1 + -(-39 // block_size)
    assert out == ref
    assert engine.counters.forwards - forwards_before == 1 + -(-39 // block_size)
    # drafts wrong at random: rows accept different counts in the same forward, the output stays exact
    for seed in range(2):
        engine = OracleDrafts(model, block_size, reference, wrong=0.25, seed=seed, eos_token_ids=[])
        got = [[] for _ in PROMPTS]
        stats = {}
        for e in engine.run(PROMPTS, 40, SamplingParams()):
            got[e.seq_id] += e.token_ids
            stats[e.seq_id] = e.stats or stats.get(e.seq_id)
        assert got == ref
        tpf = [stats[i]["tokens_per_forward"] for i in range(len(PROMPTS))]
        assert all(1 < t < block_size for t in tpf), tpf


@pytest.mark.parametrize("preset", PRESETS)
def test_exact_with_eos_and_streaming(models, preset):
    model = models[preset]
    prompt = PROMPTS[0]
    ref = _greedy_b1(model, [prompt], 30)[0]
    eos = ref[11]
    want = ref[: ref.index(eos)]
    assert _greedy_b1(model, [prompt], 30, eos=[eos])[0] == want
    # drafts right, EOS drafted in the middle of a block: it ends the request there
    engine = OracleDrafts(model, 4, {0: ref}, wrong=0.0, eos_token_ids=[eos])
    pieces = [e for e in engine.run([prompt], 30, SamplingParams()) if isinstance(e, StreamPiece)]
    assert sum((p.token_ids for p in pieces), []) == want
    assert pieces[-1].finished and pieces[-1].finish_reason == "eos" and not any(p.finished for p in pieces[:-1])
    assert [p.block for p in pieces] == list(range(len(pieces)))  # one piece per forward's committed chunk
    assert pieces[-1].stats["forward_passes"] == len(pieces)
    # streaming with the model's own drafts
    streamed = list(stream(model, prompt, 30, block_size=8, rule="exact", eos_token_ids=[eos]))
    assert sum((p.token_ids for p in streamed), []) == want and streamed[-1].finish_reason == "eos"


def test_exact_with_a_stop_string(models):
    model = models["clover-tiny-dense"]
    ref = _greedy_b1(model, [PROMPTS[2]], 24)[0]

    def decode(ids):
        return " ".join(map(str, ids))

    stop = decode(ref[9:11])
    want = generate(model, [PROMPTS[2]], 24, block_size=1, eos_token_ids=[], detokenize=decode, stop=[stop])
    engine = OracleDrafts(model, 8, {0: ref}, wrong=0.0, eos_token_ids=[], detokenize=decode)
    got = list(engine.run([PROMPTS[2]], 24, RequestOptions.of(stop=[stop])))
    assert sum((e.token_ids for e in got), []) == want.sequences[0] and got[-1].finish_reason == "stop"
    assert len(want.sequences[0]) < 24


def test_exact_mode_validation():
    small = tiny_model("clover-tiny", max_position_embeddings=64)
    # 30 + 32 fits in blocks of 4, but exact mode's last forward drafts 3 more positions
    with pytest.raises(ValueError, match=r"max_new_tokens=32.*at most 31 new tokens fit"):
        generate(small, [list(range(30))], 32, block_size=4, rule="exact")
    assert len(generate(small, [list(range(30))], 31, block_size=4, rule="exact",
                        eos_token_ids=[]).sequences[0]) == 31


@pytest.mark.parametrize("preset", PRESETS)
def test_rewind_leaves_no_trace_in_the_cache(models, preset):
    """Rows of a batch verify drafts of different lengths (right-padded), keep different counts, and do it again
    until `compact` has squeezed the holes out; each row's cache then answers a next forward exactly as a cache
    filled with its accepted tokens alone, from scratch."""
    model = models[preset]
    torch.manual_seed(1)
    prompts = [PROMPTS[0], PROMPTS[1]]
    lengths = [len(p) for p in prompts]
    longest = max(lengths)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    valid = torch.tensor([[False] * (longest - len(p)) + [True] * len(p) for p in prompts])
    kept = [list(p) for p in prompts]
    compacted = False
    with torch.inference_mode():
        cache = model.new_cache(2)
        model(ids, 1, cache=cache, attention_mask=valid)
        for fed, keep in [([5, 3], [2, 3]), ([4, 4], [1, 4]), ([2, 5], [2, 1]), ([5, 1], [5, 1]), ([3, 5], [1, 2])]:
            width = max(fed)
            drafts = torch.randint(0, 200, (2, width))
            real = torch.arange(width)[None] < torch.tensor(fed)[:, None]
            cache.mark()
            model(drafts, 4, prefix_len=width, cache=cache, attention_mask=real, query_ids=torch.full((2, 4), 255))
            before = cache.length
            cache.rewind(torch.tensor(keep))
            compacted |= cache.length < before - width + max(keep)
            for r in range(2):
                kept[r] += drafts[r, : keep[r]].tolist()
        assert compacted and 4 * (cache.length - max(len(k) for k in kept)) <= cache.length
        batched = model([[7], [7]], 4, prefix_len=1, cache=cache, query_ids=torch.full((2, 4), 255))
        for r in range(2):
            fresh = model.new_cache(1)
            model([kept[r]], 1, cache=fresh)
            alone = model([[7]], 4, prefix_len=1, cache=fresh, query_ids=torch.full((1, 4), 255))
            torch.testing.assert_close(batched.logits[r], alone.logits[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(batched.query_logits[r], alone.query_logits[0], atol=1e-4, rtol=1e-4)


def _scheduler_outputs(sched, prompts, max_new):
    async def collect(handle):
        tokens = []
        async for out in handle:
            tokens += out.token_ids
        return tokens

    async def run():
        handles = [await sched.submit(p, max_new, [SamplingParams()]) for p in prompts]
        return await asyncio.gather(*(collect(h) for h in handles)), handles

    sched.start()
    try:
        return asyncio.run(run())
    finally:
        sched.stop()


@pytest.mark.parametrize("preset", PRESETS)
def test_exact_through_the_scheduler_with_prefix_reuse(models, preset):
    """Continuous batching (requests join a running exact batch at any step) and prefix reuse."""
    model = models[preset]
    prompts = PROMPTS + [list(range(30, 57)), list(range(30, 57)) + [7, 7, 7]]  # the last two share 24 tokens
    store = PrefixCache(8, 1 << 30, recurrent=model.config.has_linear_attention)
    sched = Scheduler(model, block_size=4, threshold=0.9, rule="exact", eos_token_ids=[], prefill_chunk=8,
                      prefix_cache=store, max_running=3)
    results, handles = _scheduler_outputs(sched, prompts, 12)
    assert results == _greedy_b1(model, prompts, 12)
    assert max(handles[-1].cached_tokens) == 24 and store.stats.hits >= 1


# -- context_reading: how committed blocks are written ---------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_causal_context_reading_commits_blocks_causally(preset):
    """With `context_reading="causal"` a threshold-mode commit leaves the cache a causal prefill of the same tokens
    would; with the default `block_causal` it does not (the committed block read itself both ways)."""
    differs = {}
    for reading in ("causal", "block_causal"):
        model = tiny_model(preset, context_reading=reading)
        engine = Engine(model, 4, 0.5, eos_token_ids=[])
        seq = engine.make_sequences([PROMPTS[0]], 12, SamplingParams())[0]
        b = engine.prefill_step(engine.begin_prefill(seq))
        while len(seq.generated) < 4:
            _, b = engine.step(b)
        masks = torch.full((1, 4), model.config.mask_token_id)
        with torch.inference_mode():
            fresh = model.new_cache(1)
            model([seq.prompt + seq.generated[:4]], 1, cache=fresh)
            want = model(None, 4, cache=fresh, query_ids=masks).query_logits
            got = model(None, 4, cache=b.cache, query_ids=masks).query_logits
        differs[reading] = float((want - got).abs().max())
    assert differs["causal"] < 1e-4 < differs["block_causal"], differs


def test_exact_mode_sampling_draws_from_the_block1_distribution(models):
    """With a temperature and top-k, exact mode (drafts verified by speculative sampling) commits its first two
    tokens with the joint distribution block-size-1 sampling has, computed from the model itself; drafts that are
    often right and often wrong both occur, so acceptance and the residual draw are both exercised."""
    from clover.engine.sampling import BatchSampler
    from clover.engine.loops.speculative import target_probs

    model = models["clover-tiny-dense"]
    prompt, trials = PROMPTS[1], 3000
    params = [SamplingParams(temperature=1.5, top_k=3, seed=s) for s in range(trials)]
    banned = [model.config.mask_token_id]
    with torch.inference_mode():
        first = target_probs(BatchSampler([params[0]], 256, banned), model([prompt]).logits[:, -1:])[0, 0]
        want = {}
        for t1 in first.nonzero().flatten().tolist():
            second = target_probs(BatchSampler([params[0]], 256, banned), model([prompt + [t1]]).logits[:, -1:])[0, 0]
            for t2 in second.nonzero().flatten().tolist():
                want[(t1, t2)] = float(first[t1] * second[t2])
    greedy = _greedy_b1(model, [prompt], 3)[0]
    engine = OracleDrafts(model, 4, {i: greedy for i in range(trials)}, wrong=0.0, eos_token_ids=[])
    got: dict[tuple[int, int], int] = {}
    out = [[] for _ in range(trials)]
    for e in engine.run([prompt] * trials, 2, params):
        out[e.seq_id] += e.token_ids
    for tokens in out:
        got[tuple(tokens)] = got.get(tuple(tokens), 0) + 1
    assert set(got) <= set(want), "a pair block-size-1 sampling never draws"
    tv = 0.5 * sum(abs(got.get(pair, 0) / trials - p) for pair, p in want.items())
    assert tv < 0.05, (tv, want, got)
    assert 0.1 < first[greedy[0]] < 0.9  # the greedy draft is accepted sometimes and rejected sometimes


@pytest.mark.parametrize("stop", ["\N{GRINNING FACE}", "a\N{GRINNING FACE}b", "\N{EURO SIGN}5"])
def test_a_multibyte_stop_string_ends_output_where_it_completes_whatever_the_piece_size(stop):
    """A byte-level tokenizer spells a character in up to four tokens. The stop string is matched on text, so
    block size 1 (a token per piece) and exact mode (several per piece) end at the same token."""
    from clover.engine.request import Sequence

    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    tokens = list(("the reply: " + stop + " and more").encode())
    cuts = set()
    for size in (1, 2, 3, 5):
        seq = Sequence(0, [1], RequestOptions.of(stop=[stop]), len(tokens))
        for i in range(0, len(tokens), size):
            seq.append_block(tokens[i:i + size], 1, 1, [], decode)
            if seq.finished:
                break
        assert seq.finish_reason == "stop" and seq.stop_string == stop
        cuts.add(len(seq.generated))
    assert cuts == {len(("the reply: " + stop).encode())}


@pytest.mark.parametrize("preset", PRESETS)
def test_drafts_follow_the_cost_of_rows_and_the_output_does_not(models, preset):
    """Rows that cost nothing (a GPU): every forward drafts the whole block. Rows that cost their count (no
    batching gain): no draft ever pays, and exact mode decodes one token per one-row forward. Same tokens."""
    model = models[preset]
    ref = _greedy_b1(model, PROMPTS, 24)
    figures = {}
    for name, cost in (("flat", ForwardCost.flat()), ("proportional", ForwardCost.proportional())):
        engine = Engine(model, 4, rule="exact", cost=cost, eos_token_ids=[])
        out = [[] for _ in PROMPTS]
        for e in engine.run(PROMPTS, 24, SamplingParams()):
            out[e.seq_id] += e.token_ids
        assert out == ref
        figures[name] = engine.settings()["forwards_by_drafts"]
    flat, proportional = figures["flat"], figures["proportional"]
    assert proportional[1:] == [0, 0, 0] and proportional[0] > 0
    # the whole block, but for a prompt's last two forwards, whose drafts would reach past max_new_tokens
    assert sum(flat[:3]) <= 2 * len(PROMPTS) < flat[3], flat


def test_drafts_copied_from_the_context_fill_the_forwards_after_a_rejection(models):
    """The dense tiny model's greedy text loops, so its context predicts it: with `lookup` the forwards that the
    query block left without drafts verify copies from the context, fewer forwards give the same tokens."""
    model = models["clover-tiny-dense"]
    ref = _greedy_b1(model, PROMPTS, 48)
    runs = {}
    for lookup in (False, True):
        engine = Engine(model, 4, rule="exact", cost=ForwardCost.flat(), rule_options={"lookup": lookup},
                        eos_token_ids=[])
        got, stats = [[] for _ in PROMPTS], {}
        for e in engine.run(PROMPTS, 48, SamplingParams()):
            got[e.seq_id] += e.token_ids
            stats[e.seq_id] = e.stats or stats.get(e.seq_id)
        assert got == ref
        runs[lookup] = engine.settings()["lookup"], [stats[i]["forward_passes"] for i in range(len(PROMPTS))]
    (off, forwards_off), (on, forwards_on) = runs[False], runs[True]
    assert off == {"forwards": 0, "accepted": 0, "verified": 0}
    assert on["forwards"] > 0 and 0 < on["accepted"] <= on["verified"]
    assert all(a <= b for a, b in zip(forwards_on, forwards_off)) and sum(forwards_on) < sum(forwards_off)


def test_copied_drafts_are_judged_by_match_depth_and_replace_weaker_model_drafts(models):
    """A copy continuing a deep match is priced as nearly sure, one after a two-token match as a coin flip; where
    the model drafted too, the copy takes the row only when it promises more tokens than the model's drafts."""
    engine = Engine(models["clover-tiny-dense"], 4, rule="exact", cost=ForwardCost.flat(), eos_token_ids=[])
    loop = engine.loop
    span = list(range(100, 116))
    deep = [7] + span + [8] + span[:13]  # the last 13 tokens occurred before: the 3 after them are the copy
    shallow = [1, 2, 3, 9, 9, 1, 2]  # a two-token match
    rows = [(deep, 0.1), (shallow, 0.99), (deep, 0.99)]  # (context, the model's own acceptance)
    seqs, acceptance = [], []
    for context, p in rows:
        seqs.append(SimpleNamespace(prompt=context, generated=[], remaining=64, options=RequestOptions()))
        acc = Acceptance(3, prior=[p] * 3, strength=1000)
        acc.confidence = 1.0
        acceptance.append(acc)
    model_drafts = torch.tensor([[50, 51, 52]] * 3)
    b = SimpleNamespace(seqs=seqs, copies=[CopiedDrafts(ContextLookup(c)) for c, _ in rows], acceptance=acceptance,
                        drafts=model_drafts.clone(), n_drafts=torch.full((3,), 3), looked_up=torch.zeros(3, dtype=bool))
    loop._look_up(b)
    assert b.copies[0].depth == 13 and b.copies[1].depth == 2
    deep_p, shallow_p = (loop._copied_estimate(b, r)[0] for r in (0, 1))
    assert deep_p > 0.95 and shallow_p < deep_p - 0.1
    # row 0: the model's drafts are poor, the deep copy replaces them (what followed the match, as deep as it is)
    copy = (span[13:] + [8] + span)[:13]
    assert bool(b.looked_up[0]) and int(b.n_drafts[0]) == 13 and b.drafts[0, :13].tolist() == copy
    # row 1: a shallow copy does not displace sure model drafts; row 2: a deep one does (13 sure tokens, not 3)
    assert not bool(b.looked_up[1]) and int(b.n_drafts[1]) == 3 and b.drafts[1, :3].tolist() == [50, 51, 52]
    assert bool(b.looked_up[2]) and b.drafts[2, :13].tolist() == copy


def test_acceptance_estimates_learn_from_verified_drafts():
    acc = Acceptance(3, prior=[0.5, 0.5, 0.5], strength=2)
    acc.observe_confidence([0.99] * 20)  # the causal path is sure of its tokens: no cap below the estimate
    for _ in range(20):
        acc.observe(3, 3)  # every draft accepted
    assert acc.mean()[0] > 0.95 and all(o >= m for o, m in zip(acc.optimistic(), acc.mean()))
    for _ in range(40):
        acc.observe(3, 0)  # the text turned: the first draft rejected every time
    assert acc.mean()[0] < 0.6
    for _ in range(500):
        acc.tick()  # the evidence fades: the prior, with the optimism of little evidence
    assert abs(acc.mean()[0] - 0.5) < 0.05 and acc.optimistic()[0] > 0.75
    acc.observe_confidence([0.3] * 20)  # where the model hesitates, drafts do not look worth trying
    assert acc.optimistic()[0] < 0.35


def test_the_number_of_drafts_follows_acceptance_and_cost():
    # drafts copied from the context cost only their rows: verified while they raise this forward's tokens/s
    assert best_verified([0.9] * 3, lambda rows: 1.0 + 0.1 * rows, 3, query=4) == 3
    assert best_verified([0.9] * 3, lambda rows: float(rows), 3, query=0) == 0
    assert best_verified([0.05] * 3, lambda rows: 1.0 + 0.1 * rows, 3, query=0) == 0
    assert best_drafts([0.99] * 3, lambda rows: 1.0 + 0.1 * rows, 3) == 3
    assert best_drafts([0.5] * 3, lambda rows: float(rows), 3) == 0  # rows cost their count: nothing pays
    # free rows, but a second draft that is mostly rejected makes the next forward one without drafts: one draft
    assert best_drafts([0.95, 0.1, 0.5], lambda rows: 1.0, 3) == 1
    assert best_drafts([0.3, 0.3, 0.3], lambda rows: 1.0, 3) == 3  # free rows, drafts as likely at every position
    assert best_drafts([0.99, 0.2, 0.2], lambda rows: 1.0 + 0.1 * rows, 3) == 1


def test_a_batch_verifies_one_number_of_drafts_for_its_whole_forward():
    """Every row is as wide as the widest: one row's drafts widen all of them."""
    cheap = lambda rows: 1.0 + 0.1 * rows  # noqa: E731
    for p, most, query in (([0.9] * 3, 3, 4), ([0.05] * 3, 3, 0), ([0.6] * 3, 2, 1)):  # one row: best_verified
        assert best_batch_verified([p], [most], cheap, query) == best_verified(p, cheap, most, query)
    linear = lambda rows: 0.01 * rows  # noqa: E731  (16 sequences on two CPU cores: arithmetic-bound)
    assert best_batch_verified([[0.95] * 3] * 2 + [[0.5] * 3] * 14, [3, 3] + [0] * 14, linear, 0) == 0
    assert best_batch_verified([[0.95] * 3] * 16, [3] * 16, cheap, 0) == 3  # rows nearly free: all verified
    assert best_batch_verified([[0.9] * 3] * 4, [0] * 4, cheap, 0) == 0  # nothing to verify


def test_step_costs_not_yet_timed_follow_the_nearest_timed_size(models):
    """A batch's forward costs more than the table's one sequence of as many rows; a size not yet timed is
    priced as the nearest timed one compares with the table, so 32 rows never look cheaper than a timed 16."""
    engine = Engine(models["clover-tiny-dense"], 4, rule="exact", cost=ForwardCost.proportional(), eos_token_ids=[])
    loop = engine.loop
    loop.learns = True  # (a table given to the engine is otherwise its whole cost model)
    table = loop._step_cost(16, 32)
    assert table == pytest.approx(ForwardCost.proportional()(16, 32))  # nothing timed: the table
    for _ in range(3):  # the batch's 16 rows took twice the table's time
        loop._timed(16, time.perf_counter() - 2 * table, 0.0)
    assert loop._step_cost(16, 32) == pytest.approx(2 * table, rel=0.01)
    assert loop._step_cost(32, 32) == pytest.approx(2 * ForwardCost.proportional()(32, 32), rel=0.01)


def test_a_size_priced_in_a_slow_moment_is_priced_again_once_its_timings_age_out(models):
    """Steps of 2 rows timed during a slow moment make drafting look too dear, so the policy stops running them
    and never re-times them; after `STEP_MEMORY` steps of other sizes their price follows what is timed now."""
    engine = Engine(models["clover-tiny-dense"], 4, rule="exact", cost=ForwardCost.proportional(), eos_token_ids=[])
    loop = engine.loop
    loop.learns = True
    one = ForwardCost.proportional()(1, 32)
    for _ in range(3):
        loop._timed(2, time.perf_counter() - 50 * one, 0.0)  # 25x the table's 2 rows
    for _ in range(STEP_MEMORY - 3):
        loop._timed(1, time.perf_counter() - one, 0.0)
    assert loop._step_cost(2, 32) > 20 * ForwardCost.proportional()(2, 32)  # still remembered
    loop._timed(1, time.perf_counter() - one, 0.0)
    assert loop._step_cost(2, 32) == pytest.approx(ForwardCost.proportional()(2, 32), rel=0.05)


def test_the_table_extrapolates_past_its_last_count_by_its_upper_half():
    """Two neighbouring counts can time alike (noise): the slope past the table comes from its upper half."""
    cost = ForwardCost([1, 2, 4, 8, 12, 16], [1.0, 1.1, 1.3, 2.0, 3.0, 3.0])
    assert cost(32) > cost(16) + 16 * 0.1


def test_exact_mode_departs_from_block1_only_at_near_ties(models):
    """What is guaranteed in floating point: verifying several tokens in one forward and feeding them one at a
    time are different sums (~1e-6 apart here), so exact mode equals block size 1 wherever the two best tokens
    are further apart than that, and may part ways at a near-tie. A model whose every token has a twin (its LM
    head row plus 1e-7 noise) makes every choice a near-tie: wherever the two decodings first differ, block
    size 1's top two logits there are within 1e-4 of each other."""
    import copy

    model = copy.deepcopy(models["clover-tiny-dense"])
    half = model.config.vocab_size // 2
    with torch.no_grad():  # tokens half.. copy tokens 0..half-1 (the mask id, 255, among the copies)
        head = model.lm_head.weight
        head[half:2 * half] = head[:half] + 1e-7 * torch.randn_like(head[:half])
    ref = _greedy_b1(model, PROMPTS, 16)
    engine = Engine(model, 4, rule="exact", cost=ForwardCost.flat(), eos_token_ids=[])
    got = [[] for _ in PROMPTS]
    for e in engine.run(PROMPTS, 16, SamplingParams()):
        got[e.seq_id] += e.token_ids
    for prompt, a, b in zip(PROMPTS, got, ref):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            continue
        with torch.inference_mode():
            logits = model([prompt + b[:i]]).logits[0, -1].float()
            logits[model.config.mask_token_id] = float("-inf")
            top = logits.topk(2).values
        assert float(top[0] - top[1]) < 1e-4, (i, top)
    with torch.inference_mode():  # the twins do make near-ties: the test is not vacuous
        top = model([PROMPTS[0] + ref[0]]).logits[0].float().topk(2, dim=-1).values
    assert float((top[:, 0] - top[:, 1]).max()) < 1e-4


class ScriptedOracleLoop(OracleLoop):
    """`OracleLoop` whose every third step has no drafts (after a step that may have accepted some)."""

    def step(self, b, snapshots=False):
        events, b = super().step(b, snapshots)
        if b is not None and self.engine.counters.steps % 3 == 0:
            b.n_drafts = torch.zeros_like(b.n_drafts)
        return events, b


@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0])
def test_exact_mode_on_the_int4_hybrid_is_block1_near_ties_included(wrong):
    """The int4 hybrid (DeltaNet's C++ step, gated attention, the grouped MoE) with flat logits (logit scale 1):
    drafts accepted, partly accepted, rejected, none right after some were accepted, alone and in a batch, give
    block size 1's tokens (the bits behind it: tests/model/test_row_independence.py)."""
    model = quantize(tiny_model("clover-tiny", logit_scale=1.0), "int4")
    ref = _greedy_b1(model, PROMPTS, 24)
    for prompts in ([PROMPTS[0]], [PROMPTS[2]], PROMPTS):
        engine = Engine(model, 6, rule="exact", eos_token_ids=[])
        engine.loop = ScriptedOracleLoop(engine, {i: ref[PROMPTS.index(p)] for i, p in enumerate(prompts)}, wrong)
        got = [[] for _ in prompts]
        for e in engine.run(prompts, 24, SamplingParams()):
            got[e.seq_id] += e.token_ids
        assert got == [ref[PROMPTS.index(p)] for p in prompts]


def test_one_slow_timing_does_not_price_a_size(models):
    """A size timed once in a slow moment is still priced by the table's shape from a size timed often: a size
    priced high is not run again, so one bad timing would otherwise stick (`STEP_SAMPLES`)."""
    engine = Engine(models["clover-tiny-dense"], 4, rule="exact", cost=ForwardCost.proportional(), eos_token_ids=[])
    loop = engine.loop
    loop.learns = True
    one = ForwardCost.proportional()(1, 32)
    loop._timed(2, time.perf_counter() - 10 * one, 0.0)
    for _ in range(3):
        loop._timed(1, time.perf_counter() - one, 0.0)
    assert loop._step_cost(2, 32) == pytest.approx(ForwardCost.proportional()(2, 32), rel=0.05)


# the int4 hybrid twin's forward of k rows, ms (benchmarks/bench_hybrid.py): on the 2-core EPYC with AVX-512 VNNI, and
# on the one with AVX2 only (its `cost_ms` in benchmarks/results/bench_hybrid_avx2.json), where a second row costs
# 1.22x one
TWIN_COST = ForwardCost([1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16],
                        [20.4, 25.4, 29.9, 32.9, 39.8, 45.0, 50.4, 48.7, 59.5, 62.8, 85.6])
TWIN_COST_AVX2 = ForwardCost([1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16],
                             [40.62, 49.49, 65.59, 78.01, 93.27, 93.48, 116.27, 126.66, 160.5, 172.01, 218.36])


def _copied_drafts_policy(model, cost: ForwardCost, p: float, forwards: int,
                          rng: random.Random) -> list[tuple[int, int]]:
    """One request's forwards with copied drafts accepted at rate `p` (each draft independently), a new engine's
    estimate from the shallowest match's prior: `(verified, accepted)` per forward."""
    loop = Engine(model, 16, rule="exact", cost=cost, eos_token_ids=[]).loop
    b = SimpleNamespace(copies=[CopiedDrafts(ContextLookup([1, 2, 3]))])
    out = []
    for _ in range(forwards):
        k = loop._copies_to_verify(b, 0, cost, 15, 0)
        accepted = next((i for i in range(k) if rng.random() >= p), k)
        if k:  # as `ExactLoop.step` learns from a forward that verified copied drafts
            estimate = loop._context_estimate(0)
            estimate.tick()
            estimate.observe(k, accepted)
        out.append((k, accepted))
    return out


@pytest.mark.parametrize("cost", [TWIN_COST, TWIN_COST_AVX2], ids=["avx512", "avx2"])
@pytest.mark.parametrize("p", [0.9, 0.7, 0.5, 0.0])
def test_copied_drafts_verified_earn_near_the_best_fixed_count_from_the_first_forwards(models, p, cost):
    """Copied drafts accepted at a fixed rate `p` (a request's first 30 forwards, its estimate starting at the
    prior): the policy commits tokens per second within 10 % of the best fixed count of drafts for that `p` on the
    twin's cost curve, 0 drafts included, so drafts pay where they can and cost little where they cannot."""
    rng = random.Random(0)
    best = max(expected_tokens([p] * 15, k) / cost(1 + k) for k in range(16))
    rates = []
    for _ in range(20):  # requests
        steps = _copied_drafts_policy(models["clover-tiny-dense"], cost, p, 30, rng)
        rates.append(sum(1 + a for _, a in steps) / sum(cost(1 + k) for k, _ in steps))
    assert sum(rates) / len(rates) >= 0.9 * best


@pytest.mark.parametrize("cost", [TWIN_COST, TWIN_COST_AVX2], ids=["avx512", "avx2"])
def test_copied_drafts_that_are_never_accepted_cost_at_most_two_and_a_half_percent(models, cost):
    """p = 0 (a text where copied drafts never hold): a new engine's estimate starts at the shallow match's prior
    and verifies drafts until it learns they fail (3 in the first forward on the AVX-512 curve, 1 on the AVX2 one,
    then one a forward while the optimistic bound still pays for it); over a 96-token request the extra rows cost
    at most 2.5 % of block size 1's forwards (2.2 % and 1.8 %; the rows priced by the twin's cost curve, where a
    second row costs 1.22-1.25x one)."""
    rng = random.Random(0)
    extra = [sum(cost(1 + k) / cost(1) - 1 for k, _ in _copied_drafts_policy(models["clover-tiny-dense"], cost, 0.0,
                                                                              95, rng)) / 95 for _ in range(20)]
    assert max(extra) <= 0.025


def test_copied_drafts_that_are_accepted_grow_to_many_a_forward(models):
    """p = 0.9 from a cold estimate: within the first forwards the count verified grows past the first probe to the
    cost curve's best (5 drafts on the AVX2 twin's), and the request averages over 3 tokens a forward."""
    rng = random.Random(0)
    for _ in range(10):
        steps = _copied_drafts_policy(models["clover-tiny-dense"], TWIN_COST_AVX2, 0.9, 30, rng)
        assert max(k for k, _ in steps[:8]) >= 5
        assert sum(1 + a for _, a in steps) / len(steps) > 3


def test_a_causal_only_step_that_verifies_no_draft_is_block_size_1s_forward(monkeypatch):
    """p = 0 once the probes stop (no copied draft pays, or none is offered): on the int4 hybrid whose runner runs
    the causal path only (as `bench_hybrid.py` runs the twin), every forward after the prompt's is one row and the
    cache is never marked, so no DeltaNet state slot is recorded, copied or rewound; the tokens are block size 1's."""
    from clover.engine.loops import exact
    from clover.engine.runner import as_runner
    from clover.model.cache import CloverCache

    model = quantize(tiny_model("clover-tiny"), "int4")
    ref = _greedy_b1(model, PROMPTS[:1], 24)
    runner = as_runner(model)
    runner.causal_only = True
    marks: list[int] = []
    monkeypatch.setattr(CloverCache, "mark", lambda self: marks.append(self.length))
    monkeypatch.setattr(exact, "copied_drafts", lambda index, memory, most: ([], None, 0))
    engine = Engine(runner, 16, rule="exact", cost=TWIN_COST_AVX2, eos_token_ids=[])
    rows: list[int] = []
    forward = engine.forward
    engine.forward = lambda ids, cache, **kw: (rows.append(ids.shape[1]), forward(ids, cache, **kw))[1]
    got = [t for e in engine.run([PROMPTS[0]], 24, SamplingParams()) for t in e.token_ids]
    assert got == ref[0] and rows[1:] == [1] * (len(rows) - 1) and len(rows) == 24 and not marks
