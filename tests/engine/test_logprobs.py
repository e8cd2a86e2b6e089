"""Logprobs (`SamplingParams.logprobs`): exact mode reports the causal logits' values at every committed token (block
size 1's, whatever it drafted), a block rule the prediction of the step that unmasked the position, a prompt the
causal forward's; asking for them never changes the output."""

from __future__ import annotations

import pytest
import torch

from clover.engine import Engine, RequestOptions, SamplingParams
from clover.engine.logprobs import PromptScoring, banned_ids, log_probs
from clover.engine.runner import as_runner
from model_helpers import PROMPTS, tiny_model
from test_exact_mode import OracleDrafts, _greedy_b1

TOP = 3
WHOLE = {"adaptive": False}  # exact mode drafting whole blocks: no forward-cost calibration to wait for


@pytest.fixture(scope="module")
def model():
    return tiny_model("clover-tiny")


def _run(engine: Engine, prompts, max_new, params):
    tokens, values = [[] for _ in prompts], [[] for _ in prompts]
    for e in engine.run(prompts, max_new, params):
        tokens[e.seq_id] += e.token_ids
        if e.logprobs is not None:
            values[e.seq_id] += e.logprobs
    return tokens, values


def _causal(model, prompt, tokens):
    """`[len(tokens), V]` log-probabilities of a plain causal forward over prompt + tokens, at the positions that
    predict each token (the mask token excluded, as from every choice)."""
    ids = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        logits = model(ids, block_size=1).logits[0]
    banned = torch.tensor(banned_ids(model.config.mask_token_id, model.config.vocab_size, model.config.vocab_size))
    return log_probs(logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)], banned)


def _assert_causal(model, prompt, tokens, values, top=TOP):
    assert [v.token for v in values] == tokens
    ref = _causal(model, prompt, tokens)
    got = torch.tensor([v.logprob for v in values])
    torch.testing.assert_close(got, ref.gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=1e-5, rtol=1e-5)
    if not top:
        assert all(v.top == [] for v in values)
        return
    best, ids = ref.topk(top, dim=-1)
    assert [[t for t, _ in v.top] for v in values] == ids.tolist()
    torch.testing.assert_close(torch.tensor([[lp for _, lp in v.top] for v in values]), best, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("wrong", [0.0, 0.3])
def test_exact_mode_logprobs_are_the_causal_forwards_whatever_it_drafts(model, wrong):
    """Drafts accepted several per forward (oracle drafts, some wrong at random), rows of one batch accepting
    different counts: each committed token's values equal a plain causal forward's over the output, and block
    size 1's."""
    reference = dict(enumerate(_greedy_b1(model, PROMPTS, 24)))
    engine = OracleDrafts(model, 4, reference, wrong=wrong, eos_token_ids=[])
    tokens, values = _run(engine, PROMPTS, 24, RequestOptions.of(logprobs=TOP))
    assert tokens == [reference[i] for i in range(len(PROMPTS))]
    b1_tokens, b1_values = _run(Engine(model, 1, eos_token_ids=[]), PROMPTS, 24, RequestOptions.of(logprobs=TOP))
    assert b1_tokens == tokens
    for prompt, toks, vals, b1 in zip(PROMPTS, tokens, values, b1_values):
        _assert_causal(model, prompt, toks, vals)
        torch.testing.assert_close(torch.tensor([v.logprob for v in vals]), torch.tensor([v.logprob for v in b1]),
                                   atol=1e-5, rtol=1e-5)


def test_sampled_exact_mode_reports_the_raw_distribution(model):
    """Under temperature and top-k the values are still the model's own log-softmax (before any transform)."""
    params = RequestOptions.of(temperature=1.5, top_k=5, seed=3, logprobs=TOP)
    engine = Engine(model, 4, rule="exact", rule_options=WHOLE, eos_token_ids=[])
    tokens, values = _run(engine, PROMPTS[:1], 16, params)
    _assert_causal(model, PROMPTS[0], tokens[0], values[0])


@pytest.mark.parametrize("rule,block_size", [("threshold", 4), ("left_to_right", 8)])
def test_block_rule_logprobs_are_the_unmasking_steps(model, rule, block_size):
    """A block rule reports, per token, the prediction its step read: greedy, the token is that prediction's best;
    the output is the same as without logprobs."""
    engine = Engine(model, block_size, threshold=0.5, rule=rule, eos_token_ids=[])
    plain, none = _run(engine, PROMPTS, 20, SamplingParams())
    tokens, values = _run(engine, PROMPTS, 20, RequestOptions.of(logprobs=2))
    assert tokens == plain and none == [[], [], []]
    for toks, vals in zip(tokens, values):
        assert [v.token for v in vals] == toks
        for v in vals:
            assert len(v.top) == 2 and v.top[0][0] == v.token and v.top[0][1] == pytest.approx(v.logprob)
            assert v.logprob <= 0 and v.top[0][1] >= v.top[1][1]


def test_asking_for_logprobs_changes_no_output_and_mixes_in_a_batch(model):
    """Rows that ask and rows that do not share a batch; every row's tokens are what they are without logprobs."""
    engine = Engine(model, 4, rule="exact", rule_options=WHOLE, eos_token_ids=[])
    plain, _ = _run(engine, PROMPTS, 20, SamplingParams())
    mixed = [RequestOptions.of(logprobs=1), SamplingParams(), RequestOptions.of(logprobs=0)]
    tokens, values = _run(engine, PROMPTS, 20, mixed)
    assert tokens == plain
    assert values[1] == []
    _assert_causal(model, PROMPTS[0], tokens[0], values[0], top=1)
    _assert_causal(model, PROMPTS[2], tokens[2], values[2], top=0)


def test_prompt_scoring_is_the_causal_forward_in_any_chunking(model):
    prompt = PROMPTS[2]
    ref = _causal(model, prompt[:1], prompt[1:])
    for chunk in (3, 64):
        run = PromptScoring(as_runner(model), [prompt, prompt[:2]], TOP, [model.config.mask_token_id], chunk)
        assert not run.step() and run.step()  # one prompt per step
        scored, short = run.results()
        assert short[0] is None and short[1].token == prompt[1] and short[1].logprob == pytest.approx(
            scored[1].logprob, abs=1e-5)
        assert scored[0] is None and [v.token for v in scored[1:]] == prompt[1:]
        torch.testing.assert_close(torch.tensor([v.logprob for v in scored[1:]]),
                                   ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=1e-5, rtol=1e-5)


def test_logprobs_validation(model):
    with pytest.raises(ValueError, match="logprobs must be in"):
        RequestOptions.of(logprobs=21)
    engine = Engine(model, 4, rule="exact", rule_options=WHOLE, eos_token_ids=[])
    grammar = object()  # refused before the grammar is read
    with pytest.raises(ValueError, match="logprobs cannot be combined with a grammar"):
        engine.make_sequences([[1, 2]], 4, RequestOptions.of(logprobs=0, grammar=grammar))
