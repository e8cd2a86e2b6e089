"""Prefix reuse on the llama.cpp runner: a request resumed from a stored prefix prefills only its new tokens and
gives what a cold start gives; stored prefixes live in host memory, not in the KV cache
(`clover.runners.llamacpp`, `clover.serving.scheduling.prefix_cache`)."""

from __future__ import annotations


import openai
import pytest
import torch
from server_helpers import build_checkpoint, decode_alone, server_thread

from clover.chat_template import render_chat
from clover.conversion.gguf_export import export_gguf
from clover.engine import Engine, generate
from clover.runners.llamacpp import LlamaCppRunner
from clover.serving import ServerOptions, create_app
from clover.serving.scheduling.prefix_cache import PrefixCache

GRID = 8


@pytest.fixture(scope="module")
def gguf(tmp_path_factory, chat_tokenizer):
    directory = tmp_path_factory.mktemp("llamacpp-prefix")
    checkpoint = build_checkpoint(directory / "model", chat_tokenizer, block_size=4)
    return export_gguf(checkpoint, directory / "model.gguf", "f32")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class CountingRunner:
    """The runner, counting the clean tokens its forwards write (prefill and commits)."""

    def __init__(self, runner: LlamaCppRunner) -> None:
        self.runner, self.written = runner, 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, ids, block_size, **kwargs):
        self.written += 0 if ids is None else int(ids.numel())
        return self.runner.forward(ids, block_size, **kwargs)


@pytest.mark.parametrize("rule", ["threshold", "exact"])
def test_a_reused_prefix_prefills_only_new_tokens_and_equals_the_cold_start(gguf, rule):
    runner = CountingRunner(LlamaCppRunner(gguf, threads=1, kv_type="f32", max_rows=2, max_block_size=4))
    # (no drafting memory: the answers repeat, and drafts from earlier ones would change the forwards compared)
    engine = Engine(runner, 4, 0.9, rule, {"adaptive": False, "memory": False} if rule == "exact" else None,
                    prefill_chunk=GRID)
    store = PrefixCache(GRID, 1 << 30, recurrent=False)
    turn1 = _prompt(37, 0)
    turn2 = turn1 + _prompt(15, 1)  # an agent's next turn: the same conversation and a few new messages
    branch = turn1[:21] + _prompt(9, 2)  # the same start, another continuation
    decode_alone(engine, turn1, store)
    for prompt, reused in ((turn2, 32), (turn2, 48), (branch, 16)):
        runner.written = 0
        cold_tokens, cold_first, _ = decode_alone(engine, prompt, None)
        cold_written, runner.written = runner.written, 0
        warm_tokens, warm_first, got = decode_alone(engine, prompt, store)
        assert got == reused
        assert runner.written == cold_written - reused  # the same forwards, but for the stored prefix's tokens
        assert warm_tokens == cold_tokens
        assert torch.equal(warm_first, cold_first)
    assert store.entries and sorted(runner._free) == [0, 1]
    assert _cells_in_use(runner.runner) == 0  # the stored prefixes hold no KV cells: no forward attends over them


def _cells_in_use(runner: LlamaCppRunner) -> int:
    """Positions held, summed over every sequence id (rows' slots and the scratch id)."""
    lib, memory = runner._lib, runner._memory
    return sum(lib.llama_memory_seq_pos_max(memory, s) + 1 for s in range(runner._scratch + 1))


def test_the_store_keeps_more_prefixes_than_the_kv_cache_holds(gguf):
    runner = LlamaCppRunner(gguf, threads=1, max_rows=1, n_ctx=256)  # llama.cpp's smallest KV: 256 cells
    engine = Engine(runner, 4, 0.9, prefill_chunk=GRID)
    store = PrefixCache(GRID, 1 << 30, recurrent=False)
    prompts = [_prompt(120, seed) for seed in range(4)]  # four conversations of 120 stored tokens each
    cold = [decode_alone(engine, p + [1, 2], None, max_new=4)[0] for p in prompts]
    for prompt in prompts:
        decode_alone(engine, prompt, store, max_new=4)
    assert len(store.entries) == 4 and store.stats.evictions == 0 and _cells_in_use(runner) == 0
    for prompt, want in zip(prompts, cold):
        tokens, _, reused = decode_alone(engine, prompt + [1, 2], store, max_new=4)
        assert (tokens, reused) == (want, 120)


def test_a_stored_prefix_restores_exactly_and_cuts_shorter(gguf):
    """Saved cells come back bit for bit (saved again, the bytes are the same), and logits after a restored prefix,
    whole or cut (directly, or saved again shorter), are those of a row that prefilled the same tokens and was cut
    as long (up to the summation order of attention over cells at other places in the cache)."""
    runner = LlamaCppRunner(gguf, threads=1, kv_type="f32", max_rows=2, max_block_size=4)
    ids = torch.tensor([_prompt(30, 3)])
    block = torch.tensor([_prompt(4, 4)])
    at = torch.ones(1, 4, dtype=torch.bool)

    def next_block(cache) -> torch.Tensor:
        return runner.forward(block, 4, cache=cache, prefix_len=0, logits_at=at)

    def cold(n: int) -> torch.Tensor:
        cache = runner.new_cache(1)
        cache.mark()
        runner.forward(ids, 1, cache=cache, prefix_len=30, logits_to_keep=0)
        cache.rewind(torch.tensor([n]))
        out = next_block(cache)
        cache.select([])
        return out

    row = runner.new_cache(1)
    runner.forward(ids, 1, cache=row, prefix_len=30, logits_to_keep=0)
    stored = row.prefix(24, copy=True)
    row.select([])
    shorter = stored.prefix(16, copy=True)
    assert stored.length == 24 and shorter.length == 16 and len(shorter.data) < len(stored.data)
    assert stored.prefix(24, copy=True).storages() == stored.storages()  # the same bytes, counted once
    restored = stored.prefix(24)
    assert bytes(restored.prefix(24, copy=True).data) == bytes(stored.data)
    restored.select([])
    for source, n in ((stored, 24), (stored, 20), (shorter, 16)):
        restored = source.prefix(n)
        assert restored.lengths == [n]
        got, want = next_block(restored), cold(n)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        restored.select([])
    assert _cells_in_use(runner) == 0 and sorted(runner._free) == [0, 1]


def test_the_server_reuses_a_conversations_prefix_on_the_llamacpp_runner(gguf, chat_tokenizer):
    runner = LlamaCppRunner(gguf, threads=1, max_rows=2)
    app = create_app(runner, chat_tokenizer, ServerOptions(served_model_name="tiny", max_running=2, prefill_chunk=8))
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 4},
                {"role": "user", "content": "What is the weather in Paris?"}]
    with server_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And in Rome?"}]
        second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    ids = chat_tokenizer(render_chat(chat_tokenizer, messages, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and cached >= 8 and cached % 8 == 0
    cold = generate(LlamaCppRunner(gguf, threads=1, max_rows=1), [ids], 8, eos_token_ids=[chat_tokenizer.eos_token_id],
                    vocab_limit=len(chat_tokenizer), prefill_chunk=8).sequences[0]
    assert second.choices[0].message.content == chat_tokenizer.decode(cold, skip_special_tokens=True).strip()


def test_a_prefix_that_finds_no_room_is_a_clear_error_and_leaves_no_cells(gguf):
    runner = LlamaCppRunner(gguf, threads=1, max_rows=2, n_ctx=256)
    row = runner.new_cache(1)
    runner.forward(torch.tensor([_prompt(200, 5)]), 1, cache=row, prefix_len=200, logits_to_keep=0)
    stored = row.prefix(200, copy=True)  # 200 cells saved; the row keeps its own 200 of the 256
    with pytest.raises(RuntimeError, match="no room for a stored prefix of 200 tokens.*--ctx"):
        stored.prefix(200)
    assert _cells_in_use(runner) == 200 * runner.ids_per_slot  # the row's cells, under every id of its slot only
    row.select([])
    assert stored.prefix(200).lengths == [200]  # room again
