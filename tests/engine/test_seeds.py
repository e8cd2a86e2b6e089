"""A seed repeats: a seeded request's sampled text is a function of its seed, its prompt and the model — the same
whatever exact mode drafts (nothing, the model's query block, copies from the context, forced drafts), whatever the
cost model's timings say, whatever else is in the batch and when it joined — and it is block size 1's text. The
noise itself (clover.engine.noise) is checked against a plain-Python reference and for its law."""

from __future__ import annotations

import math
import random

import pytest
import torch

from clover.engine import Engine, SamplingParams, generate, sampling
from clover.engine.drafts.cost import ForwardCost
from clover.engine.noise import exponential_noise, noise_key
from model_helpers import PROMPTS, tiny_model
from test_exact_mode import OracleDrafts

PRESETS = ["clover-tiny", "clover-tiny-dense"]
MAX_NEW = 24
# one request per prompt; the filters and the penalty (read per drafted position) included
SAMPLING = [SamplingParams(temperature=0.7, seed=11), SamplingParams(temperature=0.9, top_p=0.9, seed=12),
            SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.3, seed=13)]


@pytest.fixture(scope="module")
def models():
    # logits spread enough (scale 3, not the default 30) that a sampled token is often not the argmax
    return {p: tiny_model(p, logit_scale=3.0) for p in PRESETS}


@pytest.fixture(scope="module")
def block1(models):
    """Block size 1's seeded text per preset: the reference."""
    out = {}
    for preset, model in models.items():
        out[preset] = generate(model, PROMPTS, MAX_NEW, block_size=1, options=SAMPLING, eos_token_ids=[]).sequences
        greedy = generate(model, PROMPTS, MAX_NEW, block_size=1, eos_token_ids=[]).sequences
        assert all(a != b for a, b in zip(out[preset], greedy))  # the requests really sample
    return out


def _run(engine: Engine, prompts=PROMPTS, sampling=SAMPLING, max_new=MAX_NEW) -> list[list[int]]:
    out = [[] for _ in prompts]
    for e in engine.run(prompts, max_new, sampling):
        out[e.seq_id] += e.token_ids
    return out


def _noise_reference(key: int, index: int) -> float:
    """`exponential_noise`'s value at one vocabulary index, in plain Python integers (no wrapping arithmetic)."""
    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    x = lowbias32(lowbias32(index ^ (key & 0xFFFFFFFF)) ^ (key >> 32))
    return -math.log(((x >> 9) + 0.5) * 2.0 ** -23)


def test_the_noise_is_a_function_of_its_key_with_the_exponential_law():
    keys = [noise_key(seed, position, step) for seed, position, step in
            [(0, 0, 0), (0, 1, 0), (1, 0, 0), (0, 0, 1), (-1, 7, 0), (2**64 - 1, 10**6, 3)]]
    assert len(set(keys)) == len(keys) and all(0 <= k < 2**64 for k in keys)
    noise = exponential_noise(keys, 49152)
    assert noise.shape == (len(keys), 49152) and noise.dtype == torch.float32
    assert torch.equal(noise, exponential_noise(keys, 49152))  # the same key, the same numbers
    for row, key in enumerate(keys):  # the tensor hash is the integer hash (int64 products wrap as 2^64 does)
        for i in random.Random(row).sample(range(49152), 50) + [0, 49151]:
            assert float(noise[row, i]) == pytest.approx(_noise_reference(key, i), rel=1e-5)
    assert noise.min() > 0 and math.isfinite(float(noise.max()))
    flat = noise.double()
    assert abs(float(flat.mean()) - 1.0) < 0.01 and abs(float(flat.var()) - 1.0) < 0.03  # Exp(1): mean 1, var 1
    assert abs(float((flat > 1.0).double().mean()) - math.exp(-1)) < 0.005
    corr = torch.corrcoef(flat)  # rows of neighbouring keys are unrelated
    assert float((corr - torch.eye(len(keys), dtype=torch.double)).abs().max()) < 0.03


@pytest.mark.parametrize("preset", PRESETS)
def test_a_seed_gives_block_size_1s_text_whatever_exact_mode_drafts(models, block1, preset):
    """No drafts (rows that cost their count), the query block's drafts every forward (free rows), copies from the
    context on top, forced drafts that are right or wrong at random: the same text, block size 1's."""
    model, ref = models[preset], block1[preset]
    policies = {"none": (ForwardCost.proportional(), {}),
                "model": (ForwardCost.flat(), {"lookup": False}),
                "model+lookup": (ForwardCost.flat(), {"lookup": True})}
    drafted = {}
    for name, (cost, options) in policies.items():
        engine = Engine(model, 4, rule="exact", cost=cost, rule_options=options, eos_token_ids=[])
        assert _run(engine) == ref, name
        drafted[name] = sum(engine.settings()["forwards_by_drafts"][1:])
    assert drafted["none"] == 0 and drafted["model"] > 0
    for wrong in (0.0, 0.3):  # forced drafts: several tokens per forward, and rows accepting different counts
        engine = OracleDrafts(model, 4, dict(enumerate(ref)), wrong=wrong, eos_token_ids=[])
        stats = {}
        out = [[] for _ in PROMPTS]
        for e in engine.run(PROMPTS, MAX_NEW, SAMPLING):
            out[e.seq_id] += e.token_ids
            stats[e.seq_id] = e.stats or stats.get(e.seq_id)
        assert out == ref, wrong
        assert all(stats[i]["tokens_per_forward"] > 1.5 for i in range(len(PROMPTS)))


@pytest.mark.parametrize("preset", PRESETS)
def test_a_seed_does_not_move_with_the_timings_the_cost_model_sees(models, block1, preset):
    """The issue this guards: how many drafts a forward verifies follows measured timings, so it moves with the
    machine's load. Step costs drawn at random every time the policy asks: the drafts vary, the text does not."""
    model, ref = models[preset], block1[preset]
    for trial in range(2):
        engine = Engine(model, 4, rule="exact", cost=ForwardCost.proportional(), eos_token_ids=[])
        rng = random.Random(trial)
        engine.loop._step_cost = lambda rows, context: rng.uniform(0.2, 5.0) * (1.0 + 0.3 * rows)
        assert _run(engine) == ref
        by_drafts = engine.settings()["forwards_by_drafts"]
        assert by_drafts[0] > 0 and sum(by_drafts[1:]) > 0, by_drafts  # the drafting really varied


def _joining(engine: Engine, prompts, sampling, arrivals: list[int]) -> list[list[int]]:
    """Request i joins the running batch at step `arrivals[i]` (exact mode: every step is a boundary)."""
    seqs = [engine.make_sequences([p], MAX_NEW, s)[0] for p, s in zip(prompts, sampling)]
    for i, s in enumerate(seqs):
        s.seq_id = i
    out = [[] for _ in seqs]
    batch, step, waiting, joined = None, 0, list(range(len(seqs))), 0
    while waiting or batch is not None:
        for i in [i for i in waiting if arrivals[i] <= step]:
            prefill, new = engine.begin_prefill(seqs[i]), None
            while new is None:
                new = engine.prefill_step(prefill)
            joined += batch is not None
            batch = engine.join(batch, new)
            waiting.remove(i)
        if batch is not None:
            events, batch = engine.step(batch)
            for e in events:
                out[e.seq_id] += e.token_ids
        step += 1
    assert joined >= 2  # requests really joined a running batch
    return out


@pytest.mark.parametrize("preset", ["clover-tiny-dense"])  # (the hybrid's rows are batched alike, and slower)
def test_a_seed_gives_the_same_text_alone_in_a_batch_and_joining_mid_flight(models, block1, preset):
    """Alone, in a batch with other seeded and greedy rows, joining a running batch: one text per seed. A batch
    drafts one number for all its rows (clover.engine.drafts.drafting), so a row's drafts differ from its drafts
    alone."""
    model, ref = models[preset], block1[preset]
    adaptive = dict(cost=ForwardCost([1, 2, 4, 8, 16, 32], [1.0, 1.05, 1.1, 1.3, 1.8, 3.0]), eos_token_ids=[])
    for i, prompt in enumerate(PROMPTS):
        assert _run(Engine(model, 4, rule="exact", **adaptive), [prompt], [SAMPLING[i]]) == [ref[i]]
    # each seeded request twice, and greedy rows between them
    prompts = PROMPTS + PROMPTS + PROMPTS[:2]
    sampling = SAMPLING + SAMPLING + [SamplingParams(), SamplingParams()]
    greedy = generate(model, PROMPTS[:2], MAX_NEW, block_size=1, eos_token_ids=[]).sequences
    want = ref + ref + greedy
    assert _run(Engine(model, 4, rule="exact", **adaptive), prompts, sampling) == want
    assert _joining(Engine(model, 4, rule="exact", **adaptive), prompts, sampling,
                    arrivals=[0, 3, 0, 1, 5, 2, 0, 4]) == want


@pytest.mark.parametrize("preset", ["clover-tiny-dense"])
def test_block_rules_repeat_a_seed_alone_and_in_a_batch(models, preset):
    """Under a block rule a position's noise is keyed by its answer position and the row's step in the block: a
    seeded request's text is the same alone, in a batch and run again (the rule's own text, not block size 1's)."""
    model = models[preset]
    batch = generate(model, PROMPTS + PROMPTS[:1], MAX_NEW, block_size=4, threshold=0.5,
                     options=SAMPLING + [SamplingParams()], eos_token_ids=[]).sequences
    for i, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], MAX_NEW, block_size=4, threshold=0.5, options=SAMPLING[i],
                         eos_token_ids=[]).sequences[0]
        assert alone == batch[i]
    assert batch[0] != batch[3]  # seeded and greedy differ: the rule samples



def test_an_unseeded_request_carries_the_seed_that_reproduces_it(models, monkeypatch):
    """The engine draws an unseeded sampled request's seed when it takes the request and keeps it on the sequence
    (what the request log records); that seed is the one its tokens were drawn with."""
    engine = Engine(models["clover-tiny"], 4, 0.5, eos_token_ids=[])
    unseeded = SamplingParams(temperature=1.0)
    drawn = engine.make_sequences(PROMPTS[:1], MAX_NEW, [unseeded])[0].options.sampling.seed
    assert drawn is not None and unseeded.seed is None
    assert engine.make_sequences(PROMPTS[:1], MAX_NEW, [SamplingParams()])[0].options.sampling.seed is None  # greedy: none
    monkeypatch.setattr(sampling, "fresh_seed", lambda: drawn)  # the next unseeded request draws the same seed
    assert _run(engine, PROMPTS[:1], [unseeded]) == _run(engine, PROMPTS[:1], [SamplingParams(temperature=1.0,
                                                                                              seed=drawn)])
