"""Prefix reuse: a request started from a stored prefix gives exactly (bit for bit) what a cold start gives."""

from __future__ import annotations

import pytest
import torch

from clover.engine import Engine, SamplingParams
from clover.engine.drafts.cost import ForwardCost
from clover.model import quantize
from clover.model.cache import CloverCache
from clover.serving.scheduling.prefix_cache import PrefixCache, chain_hashes
from clover.smol import BUILD_ACTIVATIONS
from model_helpers import tiny_model
from server_helpers import decode_alone as _decode

GRID = 8


@pytest.fixture(scope="module")
def models():
    return {"clover-tiny": tiny_model("clover-tiny"), "clover-tiny-dense": tiny_model("clover-tiny-dense")}


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=5)])
def test_reused_prefix_gives_exactly_the_cold_start_tokens(models, preset, sampling):
    model = models[preset]
    engine = Engine(model, 4, 0.5, prefill_chunk=GRID)
    store = PrefixCache(GRID, 1 << 30, recurrent=model.config.has_linear_attention)
    turn1 = _prompt(37, 0)
    turn2 = turn1 + _prompt(15, 1)  # an agent's next turn: the same conversation and a few new messages
    branch = turn1[:21] + _prompt(9, 2)  # same start, different continuation
    _decode(engine, turn1, store, sampling=sampling)
    for prompt, reused in ((turn2, 32), (turn2, 48), (branch, 16)):
        cold_tokens, cold_first, _ = _decode(engine, prompt, None, sampling=sampling)
        warm_tokens, warm_first, got = _decode(engine, prompt, store, sampling=sampling)
        assert got == reused
        assert warm_tokens == cold_tokens
        assert torch.equal(warm_first, cold_first)  # bit for bit, not merely close


@pytest.mark.parametrize("matmul", ["kernel", "fp32"])
@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
def test_reuse_on_a_packed_build_gives_exactly_the_cold_start_tokens(preset, quant, matmul, monkeypatch):
    """The int4 / int8 builds that round activations twice (clover-smol's) read prompt rows as
    `clover.model.prompt_rows.prompt_matmul` says (the fused layer's kernel, or a dequantised fp32 matmul, which rounds
    differently) and decoding rows by the kernel. A warm start reads the rest of its prompt in the chunks a cold
    start reads after the reused point, on the same path."""
    monkeypatch.setenv("CLOVER_PROMPT_MATMUL", matmul)
    grid = 32
    model = quantize(tiny_model(preset, max_position_embeddings=4 * grid), quant, activations=BUILD_ACTIVATIONS)
    # a given cost table: the policy learns no step timings, so both runs make the same drafts
    engine = Engine(model, 4, rule="exact", prefill_chunk=grid, cost=ForwardCost.flat())
    store = PrefixCache(grid, 1 << 30, recurrent=model.config.has_linear_attention)
    turn1 = _prompt(grid + 40, 6)
    turn2 = turn1 + _prompt(grid - 20, 7)  # 2 grid points and 20 rows after them
    _decode(engine, turn1, store)
    cold_tokens, cold_drafts, _ = _decode(engine, turn2, None)
    warm_tokens, warm_drafts, reused = _decode(engine, turn2, store)
    assert reused == 2 * grid
    assert warm_tokens == cold_tokens and torch.equal(warm_drafts, cold_drafts)


def test_an_agent_conversation_is_one_growing_entry(models):
    model = models["clover-tiny"]
    engine = Engine(model, 4, 0.5, prefill_chunk=GRID)
    store = PrefixCache(GRID, 1 << 30, recurrent=True, snapshot_interval=2 * GRID)
    prompt = _prompt(20, 3)
    for turn in range(4):
        _, _, reused = _decode(engine, prompt, store)
        assert reused == (0 if turn == 0 else (len(prompt) - 13) // GRID * GRID)
        prompt = prompt + _prompt(13, 10 + turn)
    assert len(store.entries) == 1  # each turn's entry superseded the previous one
    entry = next(iter(store.entries.values()))
    assert sorted(entry.states) == [16, 32, 40, 48, 56]  # every 2nd grid point, plus each turn's last one
    assert store.stats.hits == 3


def test_lookup_leaves_a_token_to_prefill_and_verifies_tokens(models):
    model = models["clover-tiny-dense"]
    store = PrefixCache(GRID, 1 << 30, recurrent=False)
    prompt = _prompt(32, 4)
    cache = model.new_cache(1)
    with torch.inference_mode():
        model(torch.tensor([prompt]), cache=cache, logits_to_keep=0)
    store.insert(prompt, cache, {})
    assert store.memory_bytes == cache.memory_bytes()["total"]  # an exact-size copy, not the request's buffers
    assert store.find(prompt).length == 24  # the whole prompt is stored, but its last token must run
    assert store.find(prompt + [1]).length == 32
    assert store.find(prompt[:17]).length == 16  # dense: any grid point of an entry
    other = list(prompt)
    other[3] = (other[3] + 1) % 250
    assert store.find(other + [1]) is None
    hit = store.find(prompt + [1])
    assert hit.cache.length == 32 and hit.cache.next_position.tolist() == [32]
    torch.testing.assert_close(hit.cache.layers[0].keys_values()[0], cache.layers[0].keys_values()[0][:, :, :32])


def test_byte_budget_evicts_least_recently_used(models):
    model = models["clover-tiny-dense"]
    caches = {}
    for seed in range(3):
        prompt = _prompt(16, 20 + seed)
        cache = model.new_cache(1)
        with torch.inference_mode():
            model(torch.tensor([prompt]), cache=cache, logits_to_keep=0)
        caches[seed] = (prompt, cache)
    one = PrefixCache(GRID, 1 << 30, recurrent=False)
    one.insert(*caches[0], {})
    size = one.memory_bytes
    store = PrefixCache(GRID, 2 * size, recurrent=False)
    store.insert(*caches[0], {})
    store.insert(*caches[1], {})
    assert store.find(caches[0][0] + [1]) is not None  # 0 is now the most recently used
    store.insert(*caches[2], {})
    assert store.stats.evictions == 1 and store.memory_bytes <= 2 * size
    counted = store.memory_bytes  # eviction subtracts what the evicted entry held alone: the same as a recount
    store._recount()
    assert store.memory_bytes == counted
    assert store.find(caches[1][0] + [1]) is None
    assert store.find(caches[0][0] + [1]) is not None and store.find(caches[2][0] + [1]) is not None
    tiny = PrefixCache(GRID, size - 1, recurrent=False)
    tiny.insert(*caches[0], {})  # 2 blocks over a budget of less: its first block is kept
    assert tiny.memory_bytes == size // 2 and next(iter(tiny.entries.values())).tokens == caches[0][0][:GRID]
    tinier = PrefixCache(GRID, size // 2 - 1, recurrent=False)
    tinier.insert(*caches[0], {})
    assert not tinier.entries and tinier.memory_bytes == 0


def test_hybrid_cache_cannot_be_cut_without_a_snapshot(models):
    model = models["clover-tiny"]
    cache = model.new_cache(1)
    with torch.inference_mode():
        model(torch.tensor([_prompt(16, 5)]), cache=cache, logits_to_keep=0)
    with pytest.raises(ValueError, match="recurrent"):
        cache.prefix(8)
    assert cache.prefix(16).length == 16


def test_chain_hashes_identify_whole_prefixes():
    a = list(range(40))
    b = list(range(40))
    b[3] = 99
    ha, hb = chain_hashes(a, GRID, 40), chain_hashes(b, GRID, 40)
    assert len(ha) == 5 and all(x != y for x, y in zip(ha, hb))  # a change early changes every later hash
    assert chain_hashes(a[:24], GRID, 24) == ha[:3]


def test_concat_left_pads_and_select_drops_shared_padding(models):
    model = models["clover-tiny"]
    caches = []
    for n in (5, 9):
        cache = model.new_cache(1)
        with torch.inference_mode():
            model(torch.tensor([_prompt(n, n)]), cache=cache, logits_to_keep=0)
        caches.append(cache)
    both = CloverCache.concat(caches)
    assert both.batch_size == 2 and both.length == 9
    assert both.valid.tolist() == [[False] * 4 + [True] * 5, [True] * 9]
    assert both.next_position.tolist() == [5, 9]
    both.select([0])
    assert both.length == 5 and bool(both.valid.all())  # the short row's padding is gone with the long row


def test_a_scope_reuses_only_its_own_prefixes(models):
    """Entries belong to the scope (an API key) that stored them: another scope's lookup of the same tokens
    misses, and neither supersedes the other's entry."""
    model = models["clover-tiny-dense"]
    store = PrefixCache(GRID, 1 << 30, recurrent=False)
    prompt = _prompt(32, 4)
    for scope in (0, 1):
        cache = model.new_cache(1)
        with torch.inference_mode():
            model(torch.tensor([prompt]), cache=cache, logits_to_keep=0)
        assert store.find(prompt, scope) is None  # scope 1 never sees scope 0's entry
        store.insert(prompt, cache, {}, scope)
    assert store.find(prompt, 0).length == store.find(prompt, 1).length == 24
    assert store.entries_of(0) == store.entries_of(1) == 1 and store.find(prompt) is None
