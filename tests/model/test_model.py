"""The model: exact to its AR references at block_size=1, cached equals uncached, block layouts agree."""

import pytest
import torch

from clover import CloverConfig, CloverForBlockDiffusion
from clover.config import FULL_ATTENTION, LINEAR_ATTENTION

LAYERS = [LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION]


# the tiny models the layout tests run on: hybrid (Gated DeltaNet reading a block both ways, or causally as arcLM
# does) and dense
MODELS = {"clover-tiny": {}, "clover-tiny-dense": {}, "clover-tiny+causal-deltanet": dict(deltanet_reading="causal")}


def tiny(preset: str, seed: int = 0, clover_params: bool = True) -> CloverForBlockDiffusion:
    """A tiny random model (a `MODELS` name); with `clover_params`, the block-only parameters are randomised too."""
    torch.manual_seed(seed)
    model = CloverForBlockDiffusion(CloverConfig.from_preset(preset.split("+")[0], **MODELS[preset])).eval()
    if clover_params:
        for name, p in model.named_parameters():
            if "conv1d_right" in name or "memory_calibration" in name:
                torch.nn.init.normal_(p, std=0.3)
    return model


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def test_block_size_one_equals_transformers_qwen3_5_moe():
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    dims = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                num_experts=8, num_experts_per_tok=2, layer_types=LAYERS)
    ref = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**dims)).eval()
    for name, p in ref.named_parameters():  # move norms / decays off their init so they are really tested
        if "norm" in name or "A_log" in name or "dt_bias" in name:
            p.add_(torch.randn_like(p) * 0.3)
    model = CloverForBlockDiffusion(CloverConfig(**dims, rope_theta=ref.config.rope_parameters["rope_theta"],
                                                 mask_token_id=299)).eval()
    missing, unexpected = model.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected
    assert sorted({m.rsplit(".", 2)[-2] if m.endswith("weight") else m.rsplit(".", 1)[-1] for m in missing}) == [
        "conv1d_right", "memory_calibration"]
    ids = torch.randint(0, 300, (2, 70))  # > one 64-token chunk of the chunked delta rule
    assert _max_diff(model(ids, block_size=1).logits, ref(ids).logits) < 1e-4


@torch.no_grad()
def test_block_size_one_equals_transformers_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                       rope_theta=10000.0)).eval()
    model = tiny("clover-tiny-dense")
    model.load_state_dict(ref.state_dict(), strict=False)
    model.lm_head.weight = model.model.embed_tokens.weight
    ids = torch.randint(0, 256, (2, 33))
    assert _max_diff(model(ids).logits, ref(ids).logits) < 1e-4


@pytest.mark.parametrize("preset", sorted(MODELS))
@torch.no_grad()
def test_cached_steps_equal_uncached_forward(preset):
    model = tiny(preset)
    ids = torch.randint(0, 250, (2, 90))
    full = model(ids).logits
    cache = model.new_cache(2)
    pieces = [model(ids[:, :70], cache=cache).logits]  # prefill in one go (two delta-rule chunks)
    pieces += [model(ids[:, t : t + 1], cache=cache).logits for t in range(70, 90)]
    assert _max_diff(torch.cat(pieces, 1), full) < 1e-4
    assert cache.length == 90 and cache.next_position.tolist() == [90, 90]


@pytest.mark.parametrize("preset", sorted(MODELS))
@pytest.mark.parametrize("block_size", [2, 4, 7])
@pytest.mark.parametrize("tail", [0, 1, -1])  # the last block whole, with one token, or one token short
@torch.no_grad()
def test_cached_blocks_equal_block_causal_forward(preset, block_size, tail):
    model = tiny(preset)
    prompt, blocks = 9, 4
    ids = torch.randint(0, 250, (2, prompt + blocks * block_size + tail))
    full = model(ids, block_size=block_size, prefix_len=prompt).logits
    cache = model.new_cache(2)
    pieces = [model(ids[:, :prompt], cache=cache).logits]
    for s in range(prompt, ids.shape[1], block_size):
        pieces.append(model(ids[:, s : s + block_size], block_size=block_size, cache=cache).logits)
    assert _max_diff(torch.cat(pieces, 1), full) < 1e-4


@pytest.mark.parametrize("preset", sorted(MODELS))
@torch.no_grad()
def test_query_blocks_read_like_the_clean_block_they_copy(preset):
    model, b, p = tiny(preset), 4, 6
    ids = torch.randint(0, 250, (2, p + 3 * b))
    full = model(ids, block_size=b, prefix_len=p).logits
    # BD3 training layout: every response block copied as a query block
    out = model(ids, block_size=b, prefix_len=p, query_ids=ids[:, p:], query_start=p)
    assert _max_diff(out.query_logits, full[:, p:]) < 1e-4
    assert _max_diff(out.logits, full) < 1e-4
    # decoding: a query block against the cache, and commit + next block in one pass
    cache = model.new_cache(2)
    model(ids[:, : p + b], block_size=b, prefix_len=p, cache=cache)
    step = model(None, block_size=b, cache=cache, query_ids=ids[:, p + b : p + 2 * b]).query_logits
    assert _max_diff(step, full[:, p + b : p + 2 * b]) < 1e-4
    assert cache.length == p + b  # query tokens are never cached
    both = model(ids[:, p + b : p + 2 * b], block_size=b, cache=cache, query_ids=ids[:, p + 2 * b :])
    assert _max_diff(both.logits, full[:, p + b : p + 2 * b]) < 1e-4
    assert _max_diff(both.query_logits, full[:, p + 2 * b :]) < 1e-4


@torch.no_grad()
def test_logits_at_selects_positions_of_clean_and_query_streams():
    model, b, p = tiny("clover-tiny"), 4, 5
    ids = torch.randint(0, 250, (2, p + 2 * b))
    out = model(ids, block_size=b, prefix_len=p, query_ids=ids[:, p:], query_start=p)
    every = torch.cat([out.logits, out.query_logits], dim=1)
    at = torch.rand(every.shape[:2]) < 0.4
    at[0, 0] = at[1, -1] = True
    sel = model(ids, block_size=b, prefix_len=p, query_ids=ids[:, p:], query_start=p, logits_at=at)
    assert sel.query_logits is None and sel.logits.shape == (int(at.sum()), every.shape[-1])
    assert _max_diff(sel.logits, every[at]) < 1e-5
    with pytest.raises(ValueError, match="logits_at must be a bool tensor of shape"):
        model(ids, block_size=b, prefix_len=p, logits_at=at)  # no query stream: wrong shape
    with pytest.raises(ValueError, match="not both"):
        model(ids, logits_to_keep=1, logits_at=at[:, : ids.shape[1]])


@torch.no_grad()
def test_in_block_tokens_read_both_ways_and_blocks_stay_causal():
    model, b = tiny("clover-tiny"), 4
    ids = torch.randint(0, 250, (1, 12))
    base = model(ids, block_size=b).logits
    later = ids.clone()
    later[0, 7] = (later[0, 7] + 1) % 250  # last token of block 1
    changed = model(later, block_size=b).logits
    assert _max_diff(changed[:, 4], base[:, 4]) > 1e-4  # block 1's first position sees its last token
    assert _max_diff(changed[:, :4], base[:, :4]) < 1e-6  # block 0 does not see block 1 (float noise only)


@torch.no_grad()
def test_causal_deltanet_reading_is_the_ar_recurrence_inside_a_block():
    """arcLM's reading: Gated DeltaNet layers run the AR recurrence through a block (and its conv has no right
    context), so a model of Gated DeltaNet layers only reads every block exactly as block size 1 does; Clover's
    reading lets a block's first token see its last."""
    torch.manual_seed(0)
    dims = dict(num_hidden_layers=2, layer_types=[LINEAR_ATTENTION] * 2)
    causal = CloverForBlockDiffusion(CloverConfig.from_preset("clover-tiny", deltanet_reading="causal", **dims)).eval()
    for name, p in causal.named_parameters():
        if "conv1d_right" in name or "memory_calibration" in name:
            torch.nn.init.normal_(p, std=0.3)
    bidirectional = CloverForBlockDiffusion(CloverConfig.from_preset("clover-tiny", **dims)).eval()
    bidirectional.load_state_dict(causal.state_dict())
    ids = torch.randint(0, 250, (2, 19))
    ar = causal(ids, block_size=1).logits
    assert _max_diff(causal(ids, block_size=4, prefix_len=3).logits, ar) < 1e-4
    query = causal(ids[:, :11], block_size=4, prefix_len=3, query_ids=ids[:, 3:11], query_start=3).query_logits
    assert _max_diff(query, ar[:, 3:11]) < 1e-4  # the training layout's query blocks too
    assert _max_diff(bidirectional(ids, block_size=4, prefix_len=3).logits, ar) > 1e-3


@pytest.mark.parametrize("preset", sorted(MODELS))
@torch.no_grad()
def test_left_padding_does_not_change_a_sequence(preset):
    model = tiny(preset)
    ids = torch.randint(0, 250, (1, 11))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 5), torch.ones(1, 11)], 1)
    cache = model.new_cache(1)
    out = model(padded, attention_mask=mask, cache=cache).logits[:, 5:]
    assert _max_diff(out, model(ids).logits) < 1e-4
    nxt = torch.randint(0, 250, (1, 4))
    assert _max_diff(model(nxt, block_size=4, cache=cache).logits,
                     model(torch.cat([ids, nxt], 1), block_size=4, prefix_len=11).logits[:, 11:]) < 1e-4


def test_new_parameters_start_at_identity():
    model = tiny("clover-tiny", clover_params=False)
    for name, p in model.named_parameters():
        if "conv1d_right" in name or "memory_calibration" in name:
            assert torch.count_nonzero(p) == 0, name


def test_recurrent_memory_is_constant_in_context_length():
    model = tiny("clover-tiny")
    cache = model.new_cache(1)
    sizes = []
    with torch.no_grad():
        for _ in range(3):
            model(torch.randint(0, 250, (1, 50)), cache=cache)
            sizes.append(cache.memory_bytes())
    assert len({s["recurrent_state"] for s in sizes}) == 1
    assert sizes[0]["attention_kv"] < sizes[1]["attention_kv"] < sizes[2]["attention_kv"]


def test_35b_preset_counts():
    with torch.device("meta"):
        model = CloverForBlockDiffusion(CloverConfig.from_preset("clover-35b-a3b"))
    assert model.config.max_position_embeddings == 131072
    assert abs(model.num_parameters() / 1e9 - 34.66) < 0.01
    assert abs(model.num_active_parameters() / 1e9 - 2.95) < 0.01
    assert abs(model.num_active_parameters(include_embeddings=False) / 1e9 - 2.44) < 0.01
    assert [i for i, t in enumerate(model.config.layer_types) if t == FULL_ATTENTION] == list(range(3, 40, 4))


def test_bf16_forward_tracks_fp32():
    model = tiny("clover-tiny")
    ids = torch.randint(0, 250, (1, 20))
    with torch.no_grad():
        ref = model(ids, block_size=4).logits
        low = model.to(torch.bfloat16)(ids, block_size=4).logits.float()
    assert _max_diff(low, ref) < 0.1
    assert model.model.rotary.inv_freq.dtype == torch.float32  # rotary angles stay exact in a bf16 model


def test_bad_inputs_name_the_problem():
    model = tiny("clover-tiny")
    with pytest.raises(ValueError, match="token ids"):
        model(torch.tensor([[0, 999]]))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.tensor([[1, 2]]), block_size=0)
    with pytest.raises(ValueError, match="multiple of block_size"):
        model(torch.tensor([[1, 2]]), block_size=4, query_ids=torch.tensor([[1, 2, 3]]))
    model.config.max_position_embeddings = 8
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.arange(10)[None], cache=model.new_cache(1))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.arange(10)[None])


def test_config_rejects_what_it_does_not_know():
    with pytest.raises(ValueError, match="unknown preset"):
        CloverConfig.from_preset("nope")
    with pytest.raises(ValueError, match="unknown keys"):
        CloverConfig.from_dict({**CloverConfig.from_preset("clover-tiny").to_dict(), "hiddden_size": 3})
    with pytest.raises(ValueError, match="layer_types"):
        CloverConfig.from_preset("clover-tiny", layer_types=["mamba"] * 4)
    with pytest.raises(ValueError, match="rope_scaling: must be None or rope_type 'llama3'"):
        CloverConfig.from_preset("clover-tiny", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope_scaling"):  # a llama3 scaling missing a field
        CloverConfig.from_preset("clover-tiny", rope_scaling={"rope_type": "llama3", "factor": 4.0})
    cfg = CloverConfig.from_preset("clover-tiny")
    assert CloverConfig.from_dict(cfg.to_dict()) == cfg
