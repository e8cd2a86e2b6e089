"""Released block-diffusion families on random twins: conventions, AR invariant, and the masks their papers state.

A twin is a tiny random transformers model in the family's released layout (Qwen3 for SDAR and dllm's A2D, Qwen3-MoE
for SDAR-MoE, Qwen2.5 for Fast-dLLM v2) with the family's `model_type` and published vocabulary, so the mask id is the
published one.
Each is converted with `clover convert --from FAMILY` and checked three ways:

* `block_size=1` logits equal the transformers AR reference (every family is AR-initialised);
* block decoding equals a reference decoder that runs the transformers model under the attention mask written out
  by hand below, reading each masked position where the family reads it (its own output, or the one to its left);
* swapping any convention (token shift, context / prompt reading, the mask id) breaks that equality.
No real weights are reachable offline: the twins check structure and conventions, not quality.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from clover import CloverForBlockDiffusion
from clover.conversion import convert
from clover.conversion.families import FAMILIES
from clover.engine import Engine, SamplingParams, generate

VOCAB = 151936  # the Qwen2.5 / Qwen3 embedding rows: the published mask ids (151665, 151669) are rows of it
DIMS = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=32, tie_word_embeddings=True, max_position_embeddings=512)
DLLM_MASK = 151660  # a twin's tokenizer mask id for dllm (its checkpoints take the tokenizer's mask token)
QWEN3_5_VOCAB = 248320  # Qwen3.5's embedding rows (arcLM's base)
ARCLM_MASK = 248077  # a twin's tokenizer mask id for arcLM (no published id: the tokenizer's mask token)
# arcLM's base, the Qwen3.5 hybrid: Gated DeltaNet and gated attention layers, dense SwiGLU
HYBRID = dict(DIMS, vocab_size=QWEN3_5_VOCAB, num_hidden_layers=4,
              layer_types=["linear_attention", "full_attention"] * 2, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4)

# Each twin: its family (`--from`), the `model_type` its released checkpoints carry, and the published conventions
# as read from the family's code (docs/families.md).
TWINS = {
    "sdar": dict(family="sdar", model_type="sdar", mask=151669, block=4, shift=False, grid="absolute"),
    "sdar_moe": dict(family="sdar", model_type="sdar_moe", mask=151669, block=4, shift=False, grid="absolute"),
    "fast_dllm_v2": dict(family="fast_dllm_v2", model_type="Fast_dLLM_Qwen", mask=151665, block=32, shift=True,
                         grid="absolute"),
    "dllm_bd3lm": dict(family="dllm_bd3lm", model_type="a2d-qwen3", mask=DLLM_MASK, block=32, shift=False,
                       grid="prompt_end"),
    "arclm": dict(family="arclm", model_type="a2d-qwen3_5", mask=ARCLM_MASK, block=64, shift=False,
                  grid="prompt_end"),
}

# Prompt [a b c], four generated tokens x1..x4 in blocks of 2; block-causal everywhere: a block sees itself both ways
# and every block before it. On a grid ending where the prompt ends ("prompt_end", dllm's staircase mask; left
# padding: [pad a] [b c] [x1 x2] [x3 x4]):
HAND_MASK = torch.tensor([
    # a  b  c x1 x2 x3 x4
    [1, 0, 0, 0, 0, 0, 0],  # a   block {pad, a}
    [1, 1, 1, 0, 0, 0, 0],  # b   block {b, c}
    [1, 1, 1, 0, 0, 0, 0],  # c
    [1, 1, 1, 1, 1, 0, 0],  # x1  block {x1, x2}
    [1, 1, 1, 1, 1, 0, 0],  # x2
    [1, 1, 1, 1, 1, 1, 1],  # x3  block {x3, x4}
    [1, 1, 1, 1, 1, 1, 1],  # x4
], dtype=torch.bool)
# On the absolute grid (SDAR's and Fast-dLLM v2's generators, `tril` over blocks from position 0): [a b] [c x1]
# [x2 x3] [x4 x5], the prompt's last token opening the first generated block (x5 is never decided: a mask).
HAND_MASK_ABSOLUTE = torch.tensor([
    # a  b  c x1 x2 x3 x4 x5
    [1, 1, 0, 0, 0, 0, 0, 0],  # a   block {a, b}
    [1, 1, 0, 0, 0, 0, 0, 0],  # b
    [1, 1, 1, 1, 0, 0, 0, 0],  # c   block {c, x1}
    [1, 1, 1, 1, 0, 0, 0, 0],  # x1
    [1, 1, 1, 1, 1, 1, 0, 0],  # x2  block {x2, x3}
    [1, 1, 1, 1, 1, 1, 0, 0],  # x3
    [1, 1, 1, 1, 1, 1, 1, 1],  # x4  block {x4, x5}
    [1, 1, 1, 1, 1, 1, 1, 1],  # x5
], dtype=torch.bool)
HAND_MASKS = {"prompt_end": HAND_MASK, "absolute": HAND_MASK_ABSOLUTE}
PROMPT = [11, 4242, 90001]
BLOCK = 2
NEW = 2 * BLOCK


def twin_reference(name: str, seed: int = 0) -> torch.nn.Module:
    from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    torch.manual_seed(seed)
    twin = TWINS[name]
    layout = FAMILIES[twin["family"]].model_types[twin["model_type"]]
    if layout == "qwen3_5":  # arcLM: under the hand-written mask its attention layers read blocks, Gated DeltaNet
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**HYBRID))  # stays causal: what arcLM's card describes
    elif layout == "qwen3_moe":  # SDAR-MoE: every layer sparse, no shared expert
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**DIMS, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=16, norm_topk_prob=True))
    elif layout == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**DIMS))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**DIMS))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.mul_(8.0)  # sharper distributions: argmax choices far from ties
    return model.eval()


def released_twin(name: str, directory: Path) -> tuple[torch.nn.Module, Path]:
    """The twin saved as its family releases it (model_type, mask id), converted to a Clover checkpoint."""
    reference = twin_reference(name)
    src = directory / f"{name}-hf"
    reference.save_pretrained(src)
    raw = json.loads((src / "config.json").read_text())
    raw["model_type"] = TWINS[name]["model_type"]
    if name in ("dllm_bd3lm", "arclm"):
        raw["mask_token_id"] = TWINS[name]["mask"]  # (what its tokenizer's mask token would give)
    (src / "config.json").write_text(json.dumps(raw))
    dst = directory / f"{name}-clover"
    convert(TWINS[name]["family"], src, dst)
    return reference, dst


@pytest.fixture(scope="module", params=sorted(TWINS))
def twin(request, tmp_path_factory) -> tuple[str, torch.nn.Module, CloverForBlockDiffusion]:
    reference, path = released_twin(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, reference, CloverForBlockDiffusion.from_pretrained(path)


def reference_decode(reference: torch.nn.Module, shift: bool, mask_id: int, grid: str = "prompt_end",
                     sub_block: int = BLOCK) -> list[int]:
    """NEW tokens decoded with the transformers model under the hand-written mask of `grid`, one token a step (the
    most confident masked position of the leftmost sub-block that has any: Fast-dLLM v2's schedule), recomputing
    the whole sequence every step. On the absolute grid the prompt's last partial block opens the first block."""
    head = len(PROMPT) % BLOCK if grid == "absolute" else 0
    seq, block, out = PROMPT[: len(PROMPT) - head], PROMPT[len(PROMPT) - head:], []
    while len(out) < NEW:
        need = min(BLOCK, head + NEW - len(out))  # positions that count (the last block may be cut)
        block += [mask_id] * (BLOCK - len(block))
        while mask_id in block[:need]:
            x = torch.tensor([seq + block])
            n = x.shape[1]
            with torch.no_grad():
                logits = reference(x, attention_mask=HAND_MASKS[grid][:n, :n][None, None]).logits[0].float()
            logits[:, mask_id] = float("-inf")
            start = len(seq)
            rows = [start + p - 1 if shift else start + p for p in range(BLOCK)]
            conf, tokens = logits[rows].softmax(-1).max(-1)
            current = min(i for i, t in enumerate(block) if t == mask_id) // sub_block
            conf[[t != mask_id or i >= need or i // sub_block != current for i, t in enumerate(block)]] = -1.0
            p = int(conf.argmax())
            block[p] = int(tokens[p])
        out += block[head:need]
        seq, block, head = seq + block, [], 0
    return out


def first_step_predictions(model: CloverForBlockDiffusion) -> torch.Tensor:
    """The engine's predictions for the first block's positions, `[B, V]` (the prefill's last forward; zeros at
    positions that hold prompt tokens)."""
    engine = Engine(model, block_size=BLOCK, threshold=1.0, eos_token_ids=[])
    seqs = engine.make_sequences([PROMPT], NEW, SamplingParams())
    with torch.inference_mode():
        return engine._prefill(seqs).logits[0].float()


def reference_first_step(reference: torch.nn.Module, shift: bool, mask_id: int, grid: str) -> torch.Tensor:
    head = len(PROMPT) % BLOCK if grid == "absolute" else 0
    x = torch.tensor([PROMPT + [mask_id] * (BLOCK - head)])
    n = x.shape[1]
    with torch.no_grad():
        logits = reference(x, attention_mask=HAND_MASKS[grid][:n, :n][None, None]).logits[0].float()
    start = len(PROMPT) - head  # the first block's first position
    want = torch.stack([logits[start + p - 1 if shift else start + p] for p in range(BLOCK)])
    want[:head] = 0.0
    return want


def test_conversion_records_the_published_conventions(twin) -> None:
    name, _, model = twin
    config, published = model.config, TWINS[name]
    assert (config.family, config.mask_token_id, config.block_size, config.token_shift) == (
        published["family"], published["mask"], published["block"], published["shift"])
    assert config.rule == ("sub_blocks" if name == "fast_dllm_v2" else "threshold")
    assert (config.context_reading, config.prompt_reading, config.block_grid) == (
        "block_causal", "blocks", published["grid"])


def test_block_size_one_equals_the_ar_reference(twin) -> None:
    _, reference, model = twin
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids, block_size=1).logits - reference(ids).logits).abs().max().item()
    assert diff < 1e-4


def test_block_decoding_equals_the_hand_written_mask(twin) -> None:
    name, reference, model = twin
    c = model.config
    expected = reference_decode(reference, c.token_shift, c.mask_token_id, c.block_grid)
    got = generate(model, [PROMPT], NEW, block_size=BLOCK, threshold=1.0, eos_token_ids=[]).sequences[0]
    assert got == expected
    want = reference_first_step(reference, c.token_shift, c.mask_token_id, c.block_grid)
    assert torch.allclose(first_step_predictions(model), want, atol=1e-4)


def test_fast_dllm_v2_decodes_its_blocks_in_sub_blocks(tmp_path: Path) -> None:
    """Its default rule fills the block's sub-blocks left to right (here sub-blocks of one: strictly left to right),
    as its generator does; the plain threshold rule (most confident first) decodes another text."""
    reference, path = released_twin("fast_dllm_v2", tmp_path)
    model = CloverForBlockDiffusion.from_pretrained(path)
    mask = model.config.mask_token_id
    expected = reference_decode(reference, True, mask, "absolute", sub_block=1)
    got = generate(model, [PROMPT], NEW, block_size=BLOCK, threshold=1.0, eos_token_ids=[],
                   rule_options={"size": 1}).sequences[0]
    assert got == expected
    assert reference_decode(reference, True, mask, "absolute") != expected  # the schedule matters on this twin
    plain = generate(model, [PROMPT], NEW, block_size=BLOCK, threshold=1.0, eos_token_ids=[], rule="threshold")
    assert plain.sequences[0] == reference_decode(reference, True, mask, "absolute")


SWAPS = {
    "token_shift": lambda c: dict(token_shift=not c.token_shift),
    "prompt_reading": lambda c: dict(prompt_reading="causal", block_grid="prompt_end"),
    "context_reading": lambda c: dict(prompt_reading="causal", context_reading="causal", block_grid="prompt_end"),
    "block_grid": lambda c: dict(block_grid="prompt_end" if c.block_grid == "absolute" else "absolute"),
    "mask_id": lambda c: dict(mask_token_id=c.mask_token_id - 1),
    "deltanet_reading": lambda c: dict(deltanet_reading="block_bidirectional" if c.deltanet_reading == "causal"
                                       else "causal"),
}


def rebuilt(model: CloverForBlockDiffusion, config) -> CloverForBlockDiffusion:
    """`model`'s weights in a model built for `config` (layers read their conventions when built)."""
    new = CloverForBlockDiffusion(config)
    new.load_state_dict(model.state_dict())
    return new.eval()


@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_a_swapped_convention_breaks_the_equality(twin, swap: str) -> None:
    _, reference, model = twin
    true = model.config
    want = reference_first_step(reference, true.token_shift, true.mask_token_id, true.block_grid)
    swapped = dataclasses.replace(true, **SWAPS[swap](true))
    original, model.config = model.config, swapped
    try:
        got = first_step_predictions(rebuilt(model, swapped) if swap == "deltanet_reading" else model)
    finally:
        model.config = original
    if swap == "deltanet_reading" and not true.has_linear_attention:  # no Gated DeltaNet layer to read otherwise
        assert torch.allclose(got, want, atol=1e-4)
        return
    assert not torch.allclose(got, want, atol=1e-3), f"swapping {swap} left the predictions unchanged"


def test_exact_mode_by_convention(twin) -> None:
    """Exact mode is block-size-1 decoding: refused without the token shift (no next-token output at committed
    tokens), equal to block size 1 greedy with it."""
    name, _, model = twin
    if not model.config.token_shift:
        with pytest.raises(ValueError, match="token_shift false"):
            generate(model, [PROMPT], 8, rule="exact")
        return
    exact = generate(model, [PROMPT], 8, block_size=4, rule="exact", eos_token_ids=[]).sequences[0]
    ar = generate(model, [PROMPT], 8, block_size=1, eos_token_ids=[]).sequences[0]
    assert exact == ar


def test_a_batch_on_the_block_grid_gives_each_prompt_what_it_gets_alone(twin) -> None:
    """Prompts whose last partial blocks differ (on the absolute grid, [42] has nothing to prefill); requests
    prefilled one by one and joined (the server's path) get the same."""
    _, _, model = twin
    prompts = [PROMPT, [5, 6, 7, 8, 9, 10], [42]]
    together = generate(model, prompts, NEW, block_size=BLOCK, eos_token_ids=[]).sequences
    alone = [generate(model, [p], NEW, block_size=BLOCK, eos_token_ids=[]).sequences[0] for p in prompts]
    assert together == alone
    engine = Engine(model, block_size=BLOCK, eos_token_ids=[])
    batch = None
    for seq in engine.make_sequences(prompts, NEW, SamplingParams()):
        job, opened = engine.begin_prefill(seq), None
        while opened is None:
            opened = engine.prefill_step(job)
        batch = engine.join(batch, opened)
    joined = {}
    while batch is not None:
        events, batch = engine.step(batch)
        for e in events:
            joined.setdefault(e.seq_id, []).extend(e.token_ids)
    assert [joined[i] for i in range(len(prompts))] == alone


def test_a_prompt_token_opening_the_first_block_is_not_output(twin) -> None:
    """On the absolute grid the prompt's last partial block opens the first block: an end-of-sequence token there is
    the prompt's, so it neither ends the answer nor appears in it."""
    _, _, model = twin
    prompt = [5, 6, 7]  # blocks of 2: on the absolute grid, 7 opens the first generated block
    free = generate(model, [prompt], NEW, block_size=BLOCK, eos_token_ids=[]).sequences[0]
    assert 7 not in free  # (so 7 as the end token can only act through the prompt)
    assert generate(model, [prompt], NEW, block_size=BLOCK, eos_token_ids=[7]).sequences[0] == free


def test_a_released_checkpoint_of_another_family_is_refused(tmp_path: Path) -> None:
    reference = twin_reference("sdar")
    reference.save_pretrained(tmp_path / "src")  # model_type "qwen3": not a released SDAR checkpoint
    with pytest.raises(ValueError, match="--from sdar expects one of"):
        convert("sdar", tmp_path / "src", tmp_path / "dst")


def test_info_names_the_family_its_conventions_and_what_clover_can_do(twin, capsys, tmp_path: Path) -> None:
    from clover.cli.main import main

    name, _, model = twin
    target = tmp_path / name
    model.save_pretrained(target)
    assert main(["info", str(target), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    twin = TWINS[name]
    assert (info["family"], info["token_shift"], info["prompt_reading"]) == (twin["family"], twin["shift"], "blocks")
    assert info["deltanet_reading"] == ("causal" if name == "arclm" else None)  # hybrids only
    assert info["block_grid"] == twin["grid"]
    can = {c["what"]: c["can"] for c in info["can"]}
    assert can["exact mode (rule 'exact')"] is twin["shift"]
    assert can["prefix reuse in the server"] is False
    assert main(["info", str(target)]) == 0
    assert FAMILIES[twin["family"]].title in capsys.readouterr().out
