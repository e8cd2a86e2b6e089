"""A hybrid (Gated DeltaNet + gated attention + MoE) model's causal path on llama.cpp (`clover.runners.llamacpp_hybrid`).

A random `clover-tiny` twin (4 layers, DeltaNet key/value heads 2/4 so the value heads' reordering matters,
8 experts with a shared one, randomised Clover-only conv and memory parameters) is exported at f32 as llama.cpp's
`qwen35moe` and run by llama.cpp with an f32 KV cache: its logits equal torch's block-size-1 forward within 1e-3,
greedy tokens equal torch's, exact mode equals block size 1 token for token on the runner (drafts from the
context, verified and rejected, the recurrent state rewound), and block rules are refused. f16 keeps the greedy
tokens; q8_0 / q4_0 / q4_k compute the model on their rounded weights. The dense hybrid (`qwen35`) gets the logits check.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from server_helpers import build_checkpoint

from clover import CloverForBlockDiffusion
from clover.conversion.gguf_export import export_gguf
from clover.engine import Engine, SamplingParams, generate
from clover.engine.loops.loop import StreamPiece
from clover.runners import llama_api
from clover.runners.registry import RunnerOptions
from clover.runners.llamacpp_open import LlamaCppFile
from clover.runners.llamacpp_hybrid import ROLLBACK, HybridCache, HybridLlamaCppRunner
from model_helpers import PROMPTS

MAX_NEW = 24
# prompts that repeat themselves, so the context offers drafts (clover.engine.drafts.lookup) that are partly right
LOOPING = [[5, 17, 3, 99, 42, 7, 11, 5, 17, 3, 99, 42, 7, 11, 5, 17], [64, 1, 2, 3, 64, 1, 2, 3, 64, 1]]


@pytest.fixture(scope="module")
def twin(tmp_path_factory, chat_tokenizer) -> tuple[Path, CloverForBlockDiffusion, HybridLlamaCppRunner]:
    directory = tmp_path_factory.mktemp("hybrid")
    checkpoint = build_checkpoint(directory / "model", chat_tokenizer, preset="clover-tiny")
    gguf = export_gguf(checkpoint, directory / "model.f32.gguf", "f32")
    runner = HybridLlamaCppRunner(gguf, threads=1, kv_type="f32", max_rows=8)
    return checkpoint, CloverForBlockDiffusion.from_pretrained(checkpoint).eval(), runner


def _all_logits(runner: HybridLlamaCppRunner, ids: list[int]) -> torch.Tensor:
    cache = runner.new_cache(1)
    try:
        at = torch.ones(1, len(ids), dtype=torch.bool)
        return runner.forward(torch.tensor([ids]), 1, cache=cache, prefix_len=len(ids), logits_at=at)
    finally:
        cache.release()


def test_the_export_is_llama_cpps_qwen35moe(twin):
    import gguf

    checkpoint, model, runner = twin
    reader = gguf.GGUFReader(str(runner.path))
    assert reader.fields["general.architecture"].contents() == "qwen35moe"
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_conv1d.weight", "blk.0.ssm_a",
            "blk.0.ssm_dt.bias", "blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight", "blk.0.ssm_norm.weight",
            "blk.0.ssm_out.weight", "blk.3.attn_q.weight", "blk.3.attn_q_norm.weight", "blk.3.post_attention_norm.weight",
            "blk.3.ffn_gate_exps.weight", "blk.3.ffn_up_exps.weight", "blk.3.ffn_down_exps.weight",
            "blk.3.ffn_gate_inp.weight", "blk.3.ffn_gate_inp_shexp.weight", "output.weight"} <= names
    assert not any("right" in n or "calibration" in n for n in names)  # Clover's block-only parameters dropped
    keys = set(reader.fields)
    assert {"qwen35moe.ssm.state_size", "qwen35moe.ssm.group_count", "qwen35moe.ssm.time_step_rank",
            "qwen35moe.rope.dimension_sections", "qwen35moe.full_attention_interval", "qwen35moe.expert_count",
            "qwen35moe.expert_shared_feed_forward_length"} <= keys
    # the runner reads the checkpoint's config back (clover.config), with exact mode as its default rule
    assert runner.config == dataclasses.replace(model.config, rule="exact") and model.config.rule == "threshold"


def test_f32_logits_equal_torchs_within_1e_3(twin):
    _, model, runner = twin
    for ids in PROMPTS + LOOPING:
        with torch.no_grad():
            want = model(torch.tensor([ids]), 1).logits[0]
        got = _all_logits(runner, ids)
        assert (got - want).abs().max() <= 1e-3, (got - want).abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_block_size_1_equals_torch(twin):
    _, model, runner = twin
    want = generate(model, PROMPTS + LOOPING, max_new_tokens=MAX_NEW, block_size=1)
    got = generate(runner, PROMPTS + LOOPING, max_new_tokens=MAX_NEW, block_size=1)
    assert got.sequences == want.sequences


def _run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    sequences: list[list[int]] = [[] for _ in prompts]
    for event in engine.run(prompts, MAX_NEW, SamplingParams()):
        if isinstance(event, StreamPiece):
            sequences[event.seq_id].extend(event.token_ids)
    return sequences


@pytest.fixture(scope="module")
def backup_runner(twin) -> HybridLlamaCppRunner:
    """The same file without rollback snapshots: rewinds by backup copy and re-decode (a build that refuses them)."""
    runner = HybridLlamaCppRunner(twin[2].path, threads=1, kv_type="f32", max_rows=8, rollback=0)
    yield runner
    runner.close()


def test_the_context_takes_the_rollback_snapshots(twin, backup_runner):
    """`n_rs_seq` written through Clover's layout of llama_context_params and read back from the context: the
    field sits where b11549 reads it, and qwen35moe has partial rollback there."""
    assert twin[2].rollback == ROLLBACK and twin[2].ids_per_slot == 1
    assert backup_runner.rollback == 0 and backup_runner.ids_per_slot == 2


def _steps(monkeypatch, runner: HybridLlamaCppRunner) -> list[list[tuple[int, int]] | None]:
    """Every forward after the prefill, as exact mode ran it: per row (tokens fed, tokens kept) where the forward
    was rewound, None for a forward with nothing to verify (no mark)."""
    log: list[list[tuple[int, int]] | None] = []
    forward, mark, rewind = runner.forward, HybridCache.mark, HybridCache.rewind

    def logged_forward(ids, block_size, *, cache, **kwargs):
        if cache.marked is None and ids is not None and ids.shape[1] == 1:
            log.append(None)
        return forward(ids, block_size, cache=cache, **kwargs)

    def logged_rewind(cache, keep):
        fed = [n - start for n, start in zip(cache.lengths, cache.marked)]
        log.append(list(zip(fed, keep.tolist())))
        rewind(cache, keep)

    monkeypatch.setattr(runner, "forward", logged_forward)
    monkeypatch.setattr(HybridCache, "mark", mark)
    monkeypatch.setattr(HybridCache, "rewind", logged_rewind)
    return log


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("rollback", [True, False], ids=["rollback", "backup"])
def test_exact_mode_equals_block_size_1_with_drafts_verified_and_rejected(twin, backup_runner, monkeypatch,
                                                                          block_size, rollback):
    """Every lookup draft verified (adaptive off), batched and alone, each prompt twice (the second time the
    drafting memory offers the first answer, accepted whole): drafts all accepted, partly accepted and all rejected
    rewind the recurrent state mid-forward (llama.cpp's rollback snapshots, or backup and re-decode), and a step
    with nothing to verify right after one that accepted some reads the state a rollback left."""
    runner = twin[2] if rollback else backup_runner
    prompts = PROMPTS + LOOPING
    want = generate(runner, prompts, max_new_tokens=MAX_NEW, block_size=1).sequences
    log = _steps(monkeypatch, runner)
    batched = Engine(runner, block_size, rule="exact", rule_options={"adaptive": False})
    assert _run(batched, prompts) == want
    assert _run(batched, prompts) == want
    alone = Engine(runner, block_size, rule="exact", rule_options={"adaptive": False})
    assert [_run(alone, [p])[0] for p in prompts] == want
    assert [_run(alone, [p])[0] for p in prompts] == want
    for engine in (batched, alone):
        forwards, accepted, verified = engine.loop.lookup_tally
        assert forwards and 0 < accepted < verified, engine.loop.lookup_tally  # some drafts kept, some rejected
    rows = [row for step in log if step for row in step]
    assert any(fed == keep > 1 for fed, keep in rows)  # every draft accepted
    assert any(1 < keep < fed for fed, keep in rows)  # some accepted, then one rejected
    assert any(keep == 1 < fed for fed, keep in rows)  # the first draft rejected
    assert any(before and any(keep > 1 for _, keep in before) and after is None
               for before, after in zip(log, log[1:]))  # no drafts right after accepted ones


@pytest.mark.parametrize("rollback", [True, False], ids=["rollback", "backup"])
def test_rewound_drafts_leave_no_trace(twin, backup_runner, rollback):
    """After `mark`, a forward of 4 tokens and `rewind` keeping some, the next forward equals a fresh sequence's
    that only ever saw the kept tokens (recurrent state and attention cells alike). Rollback snapshots go back to
    after a forward's first token at the earliest (keeping none is refused); the backup goes back to the mark."""
    runner = twin[2] if rollback else backup_runner
    rewound, fresh = runner.new_cache(1), runner.new_cache(1)
    prompt = torch.tensor([PROMPTS[2]])
    at = torch.ones(1, 1, dtype=torch.bool)
    for cache in (rewound, fresh):
        runner.forward(prompt, 1, cache=cache, prefix_len=prompt.shape[1], logits_to_keep=0)
    for keep in (2, 1, 3, 4) if rollback else (2, 0, 4):
        rewound.mark()
        runner.forward(torch.tensor([[9, 8, 7, 6]]), 1, cache=rewound, prefix_len=4, logits_to_keep=0)
        rewound.rewind(torch.tensor([keep]))
        if keep:
            runner.forward(torch.tensor([[9, 8, 7, 6][:keep]]), 1, cache=fresh, prefix_len=keep, logits_to_keep=0)
        assert rewound.lengths == fresh.lengths
        a = runner.forward(torch.tensor([[5]]), 1, cache=rewound, prefix_len=1, logits_at=at)
        b = runner.forward(torch.tensor([[5]]), 1, cache=fresh, prefix_len=1, logits_at=at)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    if rollback:
        rewound.mark()
        runner.forward(torch.tensor([[9, 8]]), 1, cache=rewound, prefix_len=2, logits_to_keep=0)
        with pytest.raises(RuntimeError, match="keeps none of the forward's tokens"):
            rewound.rewind(torch.tensor([0]))
        too_wide = torch.tensor([[1] * (runner.rollback + 1)])
        rewound.mark()
        with pytest.raises(ValueError, match=f"at most {runner.rollback} tokens a row"):
            runner.forward(too_wide, 1, cache=rewound, prefix_len=too_wide.shape[1], logits_to_keep=0)
    rewound.release()
    fresh.release()


def test_block_rules_and_query_blocks_are_refused(twin):
    _, _, runner = twin
    with pytest.raises(ValueError, match="causal path only.*block_size=1 or rule 'exact'"):
        Engine(runner, 4, 0.9, rule="threshold")
    assert Engine(runner, 4).rule.name == "exact"  # the runner's default rule: block size 1's answers
    cache = runner.new_cache(1)
    with pytest.raises(ValueError, match="causal path only"):
        runner.forward(torch.tensor([[1, 2]]), 2, cache=cache, query_ids=torch.tensor([[3, 3]]),
                       logits_to_keep=0)
    cache.release()


def test_open_picks_the_hybrid_runner(twin):
    _, _, runner = twin
    opened = LlamaCppFile.open(runner.path, RunnerOptions(threads=1, max_rows=1))
    assert isinstance(opened, HybridLlamaCppRunner)
    opened.close()


def test_f16_export_keeps_the_greedy_tokens(twin, tmp_path):
    checkpoint, model, _ = twin
    runner = HybridLlamaCppRunner(export_gguf(checkpoint, tmp_path / "f16.gguf", "f16"), threads=1, kv_type="f32",
                                  max_rows=4)
    want = generate(model, PROMPTS, max_new_tokens=MAX_NEW, block_size=1).sequences
    assert generate(runner, PROMPTS, max_new_tokens=MAX_NEW, block_size=1).sequences == want
    runner.close()


def _rounded(model: CloverForBlockDiffusion, quant: str) -> CloverForBlockDiffusion:
    """A copy of `model` whose weights went through the export's quantisation and back (`gguf`'s dequantize)."""
    import copy

    from gguf.quants import dequantize

    from clover.conversion.gguf_export import _encode, _ggml_type

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name, t in rounded.state_dict().items():
            gname = "token_embd.weight" if name == "model.embed_tokens.weight" else name
            if "conv1d" in name or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                continue  # kept at f32 (gguf_hybrid.KEEP_F32)
            qtype = _ggml_type(quant, gname, t)
            t.copy_(torch.from_numpy(np.asarray(dequantize(_encode(t, qtype, llama_api.quantize_rows), qtype),
                                                dtype=np.float32)
                                     .reshape(t.shape)))
    return rounded


@pytest.mark.parametrize("quant, shape", [("q8_0", {}), ("q4_0", {}),
                                          ("q4_k", {"hidden_size": 256, "moe_intermediate_size": 256})])
def test_quantised_exports_compute_the_rounded_weights(tmp_path, chat_tokenizer, quant, shape):
    """A q8_0 / q4_0 export computes the model with its weights rounded as the file stores them: against torch on
    those rounded weights, the logits agree up to ggml's 8-bit rounding of the activations before each quantised
    matmul (a few percent of the logits' scale on this deliberately peaked random twin). Key heads = value heads,
    so the export reorders no value heads and rounding commutes with it: the torch copy is rounded exactly as the
    file is. Every expert is used (top-k = all 8): a random router's near-ties would flip the expert choice, a jump
    that no rounding bound covers. q4_k (experts at Q4_K, written by llama.cpp's quantiser) needs rows of multiples
    of 256; ggml rounds the activations of a K-quant matmul per 256 values (Q8_K) instead of 32, and at that width
    this random twin amplifies rounding more: on it q8_0 came within 1.6-6.5 % of its rounded model, q4_k within
    9-24 % (measured; more than the activations' rounding explains so far, so its bound is loose: docs/gguf.md)."""
    import gguf

    bound = 0.3 if quant == "q4_k" else 0.06
    checkpoint = build_checkpoint(tmp_path / "model", chat_tokenizer, preset="clover-tiny", linear_num_value_heads=2,
                                  num_experts_per_tok=8, **shape)
    model = CloverForBlockDiffusion.from_pretrained(checkpoint).eval()
    rounded = _rounded(model, quant)
    runner = HybridLlamaCppRunner(export_gguf(checkpoint, tmp_path / f"{quant}.gguf", quant,
                                              kquant=llama_api.quantize_rows), threads=1, kv_type="f32", max_rows=4)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(runner.path)).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == {"q4_k": "Q4_K"}.get(quant, quant.upper())
    assert types["blk.0.ssm_conv1d.weight"] == types["blk.0.ffn_gate_inp.weight"] == "F32"
    agree = []
    for ids in PROMPTS:
        with torch.no_grad():
            want = rounded(torch.tensor([ids]), 1).logits[0]
            unrounded = model(torch.tensor([ids]), 1).logits[0]
        got = _all_logits(runner, ids)
        assert float((got - want).abs().max() / want.abs().max()) <= bound
        assert (want - unrounded).abs().max() > (got - want).abs().max() / 10  # the rounding shows: a real check
        agree += (got.argmax(-1) == want.argmax(-1)).tolist()
    assert sum(agree) / len(agree) >= (0.7 if quant == "q4_k" else 0.8)
    runner.close()


def test_the_dense_hybrid_exports_as_qwen35(tmp_path, chat_tokenizer):
    checkpoint = build_checkpoint(tmp_path / "dense", chat_tokenizer, preset="clover-tiny", mlp_type="dense",
                                  intermediate_size=64)
    runner = HybridLlamaCppRunner(export_gguf(checkpoint, tmp_path / "dense.gguf", "f32"), threads=1,
                                  kv_type="f32", max_rows=1)
    model = CloverForBlockDiffusion.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        want = model(torch.tensor([PROMPTS[2]]), 1).logits[0]
    got = _all_logits(runner, PROMPTS[2])
    assert float((got - want).abs().max()) <= 1e-3
    assert np.array_equal(got.argmax(-1).numpy(), want.argmax(-1).numpy())
    runner.close()



@pytest.mark.parametrize("padded", [True, False], ids=["twin", "alone"])
def test_a_lone_token_is_decoded_beside_a_twin(twin, padded):
    """ggml multiplies one column by an f32 matrix (the MoE routers stay f32 in every export) otherwise than several,
    so a lone token's logits part from the same token's inside a verification (on the 1.28 B q4_0 twin by up to
    5e-3; docs/gguf.md). By default a lone token is decoded beside a twin on a spare sequence (a 2-token decode,
    the spare sequence emptied after it), which rounds as a verification's rows do there; `twin=False` decodes it
    alone. The twin changes no token: greedy block size 1 is the same either way on this f32 export."""
    runner = twin[2] if padded else HybridLlamaCppRunner(twin[2].path, threads=1, kv_type="f32", max_rows=8,
                                                           twin=False)
    lib, sizes = runner._lib, []
    runner._lib = type("Counting", (), {"__getattr__": lambda _, name: getattr(lib, name),
                                        "llama_decode": lambda _, ctx, batch: sizes.append(batch.n_tokens)
                                        or lib.llama_decode(ctx, batch)})()
    try:
        got = generate(runner, [PROMPTS[0]], max_new_tokens=6, block_size=1).sequences
    finally:
        runner._lib = lib
    assert sizes == [len(PROMPTS[0])] + [2 if padded else 1] * 5
    assert lib.llama_memory_seq_pos_max(runner._memory, runner._pad_id) == -1 if padded else runner._pad_id is None
    assert got == generate(twin[2], [PROMPTS[0]], max_new_tokens=6, block_size=1).sequences
    if not padded:
        runner.close()
