"""The decoding engine against slow, obvious references: an uncached recompute decoder and `transformers`."""

from __future__ import annotations

import math

import pytest
import torch

from clover import CloverConfig, CloverForBlockDiffusion
from clover.engine import Engine, RequestOptions, SamplingParams, StepSnapshot, StreamPiece, generate, make_rule, stream
from clover.engine.reference import recompute_decode
from model_helpers import PROMPTS, tiny_model

@pytest.fixture(scope="module")
def hybrid() -> CloverForBlockDiffusion:
    return tiny_model("clover-tiny")


@pytest.fixture(scope="module")
def dense() -> CloverForBlockDiffusion:
    return tiny_model("clover-tiny-dense")


# -- exactness ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
@pytest.mark.parametrize("block_size,threshold,rule", [
    (1, 1.0, "threshold"), (3, 1.0, "threshold"), (4, 0.5, "threshold"), (4, 0.2, "threshold"),
    (5, 0.3, "no_adjacent_repeat"), (4, 1.0, "top_k_per_step"), (4, 0.5, "product_threshold"),
    (4, 0.5, "left_to_right"),
])
def test_cached_decoding_equals_recompute(preset: str, block_size: int, threshold: float, rule: str,
                                          hybrid, dense) -> None:
    model = hybrid if preset == "clover-tiny" else dense
    eos = model.config.eos_token_ids
    rule_obj = make_rule(rule, threshold=threshold)
    result = generate(model, PROMPTS, max_new_tokens=18, block_size=block_size, threshold=threshold, rule=rule)
    for prompt, got, stats in zip(PROMPTS, result.sequences, result.stats):
        want = recompute_decode(model, prompt, 18, block_size, rule_obj, eos)
        assert got == want.tokens
        assert stats["steps_per_block"] == want.steps_per_block
        assert stats["forward_passes"] == want.forwards <= sum(want.steps_per_block)
        assert stats["tokens"] == len(got)
        if block_size == 1 or (threshold == 1.0 and rule == "threshold"):
            assert stats["tokens"] <= sum(stats["steps_per_block"])  # one token per step (a forward may be skipped)


def test_low_thresholds_decode_several_tokens_per_forward(hybrid, dense) -> None:
    """The parallel path is really exercised: a block decided in one step costs one forward."""
    for model in (hybrid, dense):
        result = generate(model, PROMPTS, max_new_tokens=24, block_size=4, threshold=0.2, eos_token_ids=[])
        assert max(s["tokens_per_forward"] for s in result.stats) > 1.5
        assert any(1 in s["steps_per_block"] for s in result.stats)
        for s in result.stats:  # never more forwards than AR would take: at least one token per step
            assert s["tokens_per_forward"] >= 1.0


def test_lm_head_runs_only_where_a_position_is_still_needed(hybrid, monkeypatch) -> None:
    """Each forward computes logits for the block positions that can still be filled, no more; a step left with
    only position 0 (predicted from committed tokens) runs no forward. Tokens stay those of the recompute
    decoder (`test_cached_decoding_equals_recompute` covers this configuration)."""
    forward, rows = hybrid.forward, []

    def spy(*args, **kwargs):
        rows.append(int(kwargs["logits_at"].sum()))
        return forward(*args, **kwargs)

    monkeypatch.setattr(hybrid, "forward", spy)
    engine = Engine(hybrid, 3, 1.0)
    list(engine.run(PROMPTS, 18, SamplingParams()))
    assert engine.counters.forwards == len(rows) < engine.counters.steps
    assert all(1 <= n <= len(PROMPTS) * 3 for n in rows)
    assert sum(rows) < len(rows) * len(PROMPTS) * 3


def test_forward_passes_count_the_forwards_run(hybrid) -> None:
    """A request's `forward_passes` is the forwards it ran: a step left with only position 0 runs none, so the
    figure is below its step count (it used to count steps)."""
    fewer = False
    for prompt in PROMPTS:
        engine = Engine(hybrid, 3, 1.0)
        stats = [e.stats for e in engine.run([prompt], 18, SamplingParams()) if e.stats is not None][0]
        assert stats["forward_passes"] == engine.counters.forwards
        fewer |= stats["forward_passes"] < sum(stats["steps_per_block"])
    assert fewer


def _llama_pair(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    reference = transformers.LlamaForCausalLM(config).eval()
    clover_config = CloverConfig.from_preset("clover-tiny-dense", max_position_embeddings=512, eos_token_id=None,
                                             norm_type="plain", attn_output_gate=False, qk_norm=False,
                                             partial_rotary_factor=1.0, mlp_type="dense", mask_token_id=255)
    model = CloverForBlockDiffusion(clover_config).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    return reference, model


def test_block1_greedy_reproduces_transformers_generate() -> None:
    """B = 1, threshold 1.0 is AR decoding: token for token what `transformers` generates greedily."""
    reference, model = _llama_pair()
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                  eos_token_id=None, pad_token_id=0,
                                  suppress_tokens=[255])[0, len(prompt):].tolist()  # Clover never emits [MASK]
        result = generate(model, [prompt], max_new_tokens=40, block_size=1, threshold=1.0)
        assert result.sequences[0] == want
        assert result.stats[0]["forward_passes"] == 40 and result.stats[0]["tokens_per_forward"] == 1.0


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
def test_batch_equals_single(preset: str, hybrid, dense) -> None:
    """Left-padded prompts in lockstep, rows leaving early, greedy and seeded sampling: each row as alone."""
    model = hybrid if preset == "clover-tiny" else dense
    alone = generate(model, PROMPTS, max_new_tokens=20, threshold=0.5, eos_token_ids=[]).sequences
    others = set(alone[1] + alone[2])
    eos = next(t for i, t in enumerate(alone[0]) if i >= 5 and t not in alone[0][:i] and t not in others)
    for kwargs in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 3}):
        kw = dict(max_new_tokens=20, block_size=4, threshold=0.5, eos_token_ids=[eos], **kwargs)
        batch = generate(model, PROMPTS, **kw)
        for prompt, got, stats in zip(PROMPTS, batch.sequences, batch.stats):
            single = generate(model, [prompt], **kw)
            assert got == single.sequences[0]
            assert stats["steps_per_block"] == single.stats[0]["steps_per_block"]
        if not kwargs:
            assert batch.stats[0]["finish_reason"] == "eos" and len(batch.sequences[0]) < 20
            assert batch.stats[1]["finish_reason"] == batch.stats[2]["finish_reason"] == "length"


def test_tensor_input_with_attention_mask_and_model_generate(hybrid) -> None:
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    result = generate(hybrid, ids, attention_mask=mask, max_new_tokens=6)
    assert result.sequences == generate(hybrid, [[5, 6, 7], [1, 2, 3, 4, 5]], max_new_tokens=6).sequences
    via_model = hybrid.generate([[5, 6, 7]], max_new_tokens=6)  # block_size/threshold from the config
    assert via_model.sequences[0] == result.sequences[0]
    assert set(via_model.stats[0]) >= {"tokens", "forward_passes", "tokens_per_forward", "wall_time_s",
                                       "tokens_per_second", "time_to_first_token_s", "steps_per_block"}
    assert hybrid.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, block_size=4,
                           threshold=hybrid.config.threshold).sequences == via_model.sequences


# -- block structure (model level) --------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
def test_bidirectional_inside_a_block_causal_between_blocks(preset: str, hybrid, dense) -> None:
    model = hybrid if preset == "clover-tiny" else dense
    prompt, b = 5, 4
    ids = torch.randint(0, 250, (1, prompt + 3 * b), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        base = model(ids, block_size=b, prefix_len=prompt).logits
        end_of_block = ids.clone()
        end_of_block[0, prompt + 2 * b - 1] = (end_of_block[0, prompt + 2 * b - 1] + 1) % 250  # last of block 1
        changed = model(end_of_block, block_size=b, prefix_len=prompt).logits
        later = ids.clone()
        later[0, prompt + 2 * b] = (later[0, prompt + 2 * b] + 1) % 250  # first of block 2
        unchanged = model(later, block_size=b, prefix_len=prompt).logits
    start = prompt + b
    # logits are ~30x a plain model's here (peaked on purpose): "unchanged" means fp32 round-off, "changed" is O(1)
    assert (changed[0, start] - base[0, start]).abs().max() > 0.1, "the block's start must see its end"
    torch.testing.assert_close(changed[0, :start], base[0, :start], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(unchanged[0, : prompt + 2 * b], base[0, : prompt + 2 * b], atol=1e-4, rtol=1e-5)


def test_deltanet_history_memory_is_constant(hybrid) -> None:
    cache = hybrid.new_cache(1)
    b, seen = hybrid.config.block_size, []
    with torch.inference_mode():
        hybrid(torch.randint(0, 250, (1, 16)), block_size=b, prefix_len=16, cache=cache)
        for _ in range(3):
            for _ in range(32):
                hybrid(torch.randint(0, 250, (1, b)), block_size=b, cache=cache, logits_to_keep=0)
            seen.append(cache.memory_bytes())
    assert len({m["recurrent_state"] for m in seen}) == 1 and seen[0]["recurrent_state"] > 0
    assert seen[0]["attention_kv"] < seen[1]["attention_kv"] < seen[2]["attention_kv"]


# -- stopping -----------------------------------------------------------------------------------------------
def test_eos_in_the_middle_of_a_block_ends_the_request(hybrid) -> None:
    full = generate(hybrid, PROMPTS[:1], max_new_tokens=24, block_size=4, threshold=0.5, eos_token_ids=[])
    tokens = full.sequences[0]
    k = next(i for i, t in enumerate(tokens) if i >= 4 and i % 4 in (1, 2) and t not in tokens[:i])
    result = generate(hybrid, PROMPTS[:1], max_new_tokens=24, block_size=4, threshold=0.5, eos_token_ids=[tokens[k]])
    assert result.sequences[0] == tokens[:k]  # EOS and everything after it excluded
    stats = result.stats[0]
    assert stats["finish_reason"] == "eos" and stats["tokens"] == k
    assert stats["blocks"] == k // 4 + 1
    assert stats["steps_per_block"][-1] <= k % 4 + 1  # positions after EOS are never decided
    assert stats["forward_passes"] <= sum(full.stats[0]["steps_per_block"][: k // 4 + 1])


def test_max_new_tokens_cuts_the_last_block(hybrid) -> None:
    result = generate(hybrid, PROMPTS[:1], max_new_tokens=6, block_size=4, threshold=1.0, eos_token_ids=[])
    assert len(result.sequences[0]) == 6 and result.stats[0]["finish_reason"] == "length"
    assert result.stats[0]["steps_per_block"] == [4, 2]  # the cut block decides only the 2 positions that count


def test_stop_string_ends_the_request(hybrid) -> None:
    detok = lambda ids: "".join(chr(ord("a") + t % 26) for t in ids)  # noqa: E731
    full = generate(hybrid, PROMPTS[:1], max_new_tokens=16, eos_token_ids=[]).sequences[0]
    text = detok(full)
    stop = text[6:8]
    cut = text.index(stop) + len(stop)
    result = generate(hybrid, PROMPTS[:1], max_new_tokens=16, eos_token_ids=[], stop=[stop], detokenize=detok)
    assert result.sequences[0] == full[:cut]
    assert result.stats[0]["finish_reason"] == "stop" and result.stats[0]["stop_string"] == stop


def test_stop_string_ends_decoding_as_soon_as_it_is_complete(hybrid) -> None:
    """Reading order, one token per step: a stop string complete at position `k - 8` of the second block ends
    the block there, so it takes `k - 7` steps, not 8, and no forward runs after it; the output is cut as before."""
    detok = lambda ids: "".join(chr(ord("a") + t % 26) for t in ids)  # noqa: E731
    kw = dict(max_new_tokens=16, block_size=8, threshold=1.0, rule="left_to_right", eos_token_ids=[])
    full = generate(hybrid, PROMPTS[:1], **kw)
    text = detok(full.sequences[0])
    k = next(i for i in range(9, 16) if text[i - 1:i + 1] not in text[:i])  # first occurrence ends at block pos 1+
    stop = text[k - 1:k + 1]
    engine = Engine(hybrid, 8, 1.0, "left_to_right", eos_token_ids=[], detokenize=detok)
    events = list(engine.run(PROMPTS[:1], 16, RequestOptions.of(stop=(stop,))))
    stats = events[-1].stats
    assert sum((e.token_ids for e in events), []) == full.sequences[0][:k + 1]
    assert stats["finish_reason"] == "stop" and stats["stop_string"] == stop
    assert stats["steps_per_block"] == [8, k - 7]
    assert stats["forward_passes"] == engine.counters.forwards == k + 1
    assert [len(e.token_ids) for e in events] == [8, k - 7] and events[-1].finished


# -- streaming ----------------------------------------------------------------------------------------------
def test_stream_pieces_and_snapshots(hybrid) -> None:
    kw = dict(max_new_tokens=10, block_size=4, threshold=0.5, eos_token_ids=[])
    events = list(stream(hybrid, PROMPTS[0], snapshots=True, **kw))
    pieces = [e for e in events if isinstance(e, StreamPiece)]
    assert [len(p.token_ids) for p in pieces] == [4, 4, 2]
    assert pieces[-1].finished and pieces[-1].stats["tokens"] == 10 and not pieces[0].finished
    assert sum((p.token_ids for p in pieces), []) == generate(hybrid, PROMPTS[:1], **kw).sequences[0]
    snaps = [e for e in events if isinstance(e, StepSnapshot)]
    assert len(snaps) == sum(pieces[-1].stats["steps_per_block"])  # one per step
    for block, piece in enumerate(pieces):
        mine = [s for s in snaps if s.block == block]
        assert [s.step for s in mine] == list(range(1, len(mine) + 1))
        assert mine[-1].tokens[: len(piece.token_ids)] == piece.token_ids
        assert sum(sum(s.new) for s in mine) >= len(piece.token_ids)
        for s in mine:  # a newly filled position was masked before and is filled now
            assert all(t is not None for t, new in zip(s.tokens, s.new) if new)


# -- errors and long prompts ---------------------------------------------------------------------------------
def test_bad_inputs_name_the_parameter(hybrid) -> None:
    cases = [
        (dict(prompts=[[]]), "prompt 0 is empty"),
        (dict(prompts=[]), "prompts is empty"),
        (dict(block_size=0), "block_size"),
        (dict(threshold=0.0), "threshold"),
        (dict(threshold=1.5), "threshold"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(prompts=[[1, 999]]), "token ids"),
        (dict(stop=["x"]), "detokeniz"),
        (dict(rule="nope"), "unknown unmasking rule"),
        (dict(prefill_chunk=0), "prefill_chunk"),
    ]
    for kwargs, match in cases:
        kwargs = {"prompts": [[1, 2]], **kwargs}
        with pytest.raises(ValueError, match=match):
            generate(hybrid, kwargs.pop("prompts"), **kwargs)
    with pytest.raises(TypeError, match="unknown generation arguments"):
        generate(hybrid, [[1, 2]], temprature=0.5)
    with pytest.raises(ValueError, match="mask_token_id"):
        generate(tiny_model("clover-tiny-dense", mask_token_id=None), [[1, 2]])
    with pytest.raises(ValueError, match="max_new_tokens"):  # raised when stream is called, not at first next()
        stream(hybrid, [[1, 2]], max_new_tokens=-1)


def test_every_sampling_field_is_a_keyword(hybrid) -> None:
    # the keywords are SamplingParams' fields, whatever field it gains (logprobs was once left out by hand)
    pieces = [e for e in stream(hybrid, [1, 2], max_new_tokens=4, logprobs=2) if isinstance(e, StreamPiece)]
    assert pieces and all(p.logprobs is not None and len(p.logprobs) == len(p.token_ids) for p in pieces)


def test_context_limit_names_max_new_tokens() -> None:
    model = tiny_model("clover-tiny", max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"max_new_tokens=40.*context of 64 positions \(the model.s max_position_embeddings\)"):
        generate(model, [list(range(30))], max_new_tokens=40)
    with pytest.raises(ValueError, match="max_new_tokens=33"):  # 30 + 33 fits, but not rounded to blocks of 4
        generate(model, [list(range(30))], max_new_tokens=33)
    assert len(generate(model, [list(range(30))], max_new_tokens=32, eos_token_ids=[]).sequences[0]) == 32


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
def test_chunked_prefill_equals_unchunked(preset: str, hybrid, dense) -> None:
    model = hybrid if preset == "clover-tiny" else dense
    prompts = [torch.randint(0, 250, (300,), generator=torch.Generator().manual_seed(1)).tolist(), list(range(70))]
    batches = []
    for chunk in (64, 4096):
        engine = Engine(model, 4, 0.5, prefill_chunk=chunk)
        with torch.inference_mode():
            batches.append(engine._prefill(engine.make_sequences(prompts, 8, SamplingParams())))
        assert engine.counters.forwards == math.ceil(300 / chunk)
    chunked, whole = batches
    torch.testing.assert_close(chunked.logits, whole.logits, atol=1e-4, rtol=1e-4)
    a = generate(model, prompts, max_new_tokens=12, threshold=0.5, prefill_chunk=64)
    b = generate(model, prompts, max_new_tokens=12, threshold=0.5)
    assert a.sequences == b.sequences and a.stats[0]["prefill_forwards"] == 5


@pytest.mark.slow
def test_32k_prompt_prefills_in_chunks() -> None:
    model = tiny_model("clover-tiny")
    prompt = torch.randint(0, 250, (32768,), generator=torch.Generator().manual_seed(0)).tolist()
    result = generate(model, [prompt], max_new_tokens=8, prefill_chunk=2048)
    assert result.stats[0]["prefill_forwards"] == 16 and len(result.sequences[0]) <= 8
