"""The prefix cache's shared KV blocks: a prefix that several entries share is stored once, per API key, counted
once by the budget, evicted leaves first, and a request resumed from blocks of other requests decodes exactly
what a cold start decodes."""

from __future__ import annotations

import pytest
import torch

from clover.engine import Engine
from clover.model.cache import AttentionLayerCache
from clover.serving.scheduling.prefix_cache import PrefixCache
from model_helpers import tiny_model
from server_helpers import decode_alone as _decode

GRID = 8


@pytest.fixture(scope="module")
def dense():
    return tiny_model("clover-tiny-dense")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefilled(model, prompt: list[int]):
    cache = model.new_cache(1)
    with torch.inference_mode():
        model(torch.tensor([prompt]), cache=cache, logits_to_keep=0)
    return cache


def _block_bytes(model, store_grid: int = GRID) -> int:
    store = PrefixCache(store_grid, 1 << 30, recurrent=False)
    prompt = _prompt(store_grid, 99)
    store.insert(prompt, _prefilled(model, prompt), {})
    return store.memory_bytes


def test_a_shared_start_is_stored_once(dense):
    """Two conversations with the same system prompt and tools (24 tokens) and different messages after it: the
    three blocks they share are one copy, and the budget counts them once."""
    tools = _prompt(24, 1)
    a, b = tools + _prompt(8, 2), tools + _prompt(16, 3)
    store = PrefixCache(GRID, 1 << 30, recurrent=False)
    store.insert(a, _prefilled(dense, a), {})
    store.insert(b, _prefilled(dense, b), {})
    first, second = (entry.cache.blocks for entry in store.entries.values())
    assert all(x is y for x, y in zip(first[:3], second[:3])) and first[3] is not second[3]
    assert store.memory_bytes == (4 + 2) * _block_bytes(dense)  # 6 unique blocks, not 4 + 5
    counted = store.memory_bytes
    store._recount()
    assert store.memory_bytes == counted


def test_blocks_are_never_shared_across_keys(dense):
    prompt = _prompt(32, 4)
    store = PrefixCache(GRID, 1 << 30, recurrent=False)
    store.insert(prompt, _prefilled(dense, prompt), {}, scope=0)
    assert store.find(prompt + [1], scope=1) is None
    store.insert(prompt, _prefilled(dense, prompt), {}, scope=1)
    first, second = (entry.cache.blocks for entry in store.entries.values())
    assert not any(x is y for x, y in zip(first, second))  # the same tokens, two keys: two copies
    assert store.memory_bytes == 8 * _block_bytes(dense)


def test_eviction_cuts_the_oldest_entry_from_its_end(dense):
    """Over budget, the least recently used entry gives back its last blocks first: its start (a system prompt and
    tools a later conversation may send again) stays as long as the budget allows."""
    old, new = _prompt(40, 5), _prompt(24, 6)
    block = _block_bytes(dense)
    store = PrefixCache(GRID, 6 * block, recurrent=False)
    store.insert(old, _prefilled(dense, old), {})
    store.insert(new, _prefilled(dense, new), {})  # 5 + 3 blocks: the old entry loses its last 2
    assert store.memory_bytes == 6 * block and store.stats.evictions == 0 and store.stats.cuts == 2
    assert store.find(old + [1]).length == 24  # its first 3 blocks are still there
    assert store.find(new + [1]).length == 24


def test_eviction_frees_shared_blocks_last(dense):
    """An old conversation that shares its start with a newer one is cut back to the shared part: the shared blocks
    stay (the newer entry holds them), its own blocks go."""
    tools = _prompt(16, 7)
    old, new = tools + _prompt(16, 8), tools + _prompt(8, 9)
    block = _block_bytes(dense)
    store = PrefixCache(GRID, 3 * block, recurrent=False)
    store.insert(old, _prefilled(dense, old), {})
    store.insert(new, _prefilled(dense, new), {})
    assert store.memory_bytes == 3 * block and store.stats.cuts == 2
    assert store.find(tools + _prompt(9, 10)).length == 16 and store.find(new + [1]).length == 24


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
def test_a_prefix_assembled_from_other_requests_blocks_decodes_the_cold_tokens(preset):
    """Conversation `b` resumes from blocks that conversation `a` stored (its start) after `a` was cut by the
    budget: it decodes, bit for bit, what a cold start decodes."""
    model = tiny_model(preset)
    engine = Engine(model, 4, 0.5, prefill_chunk=GRID)
    tools = _prompt(24, 11)
    a, b = tools + _prompt(21, 12), tools + _prompt(13, 13)
    store = PrefixCache(GRID, 1 << 30, recurrent=model.config.has_linear_attention)
    _decode(engine, a, store)
    cold_tokens, cold_first, _ = _decode(engine, b, None)
    warm_tokens, warm_first, reused = _decode(engine, b, store)
    assert reused == 24 and warm_tokens == cold_tokens and torch.equal(warm_first, cold_first)


def test_kv_is_allocated_once_at_its_expected_size_and_grows_by_quarters():
    """The KV buffer is allocated at the length the request is expected to reach (its prompt and answer), and
    grows by a quarter past it, not by doubling (which left up to half of an fp32 KV unused)."""
    layer = AttentionLayerCache()
    layer.expected = 300
    kv = torch.zeros(1, 2, 256, 4)
    layer.append(kv, kv)
    assert layer.k.shape[2] == 300
    layer.append(kv[:, :, :100], kv[:, :, :100])  # 356 positions: past what was expected
    assert 356 <= layer.k.shape[2] <= 356 * 5 // 4 + 64
    assert torch.equal(layer.k[:, :, :356], torch.zeros(1, 2, 356, 4))
