"""Released block-diffusion families on random twins: conventions, AR invariant, and the masks their papers state.

A twin is a tiny random transformers model in the family's released layout (Qwen3 for SDAR and dllm's A2D, Qwen2.5
for Fast-dLLM v2) with the family's `model_type` and published vocabulary, so the mask id is the published one.
Each is converted with `clover convert --from FAMILY` and checked three ways:

* `block_size=1` logits equal the transformers AR reference (all three are AR-initialised);
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

# The published conventions, as read from each family's code (docs/families.md).
PUBLISHED = {
    "sdar": dict(mask=151669, block=4, shift=False),
    "fast_dllm_v2": dict(mask=151665, block=32, shift=True),
    "dllm_bd3lm": dict(mask=DLLM_MASK, block=32, shift=False),
}

# Prompt [a b c], two generated blocks of 2 [x1 x2] [x3 x4]; block-causal everywhere, the prompt on the block grid
# ending where it ends (left padding: [pad a] [b c]): a block sees itself both ways and every block before it.
# (dllm's staircase mask; SDAR's and Fast-dLLM v2's block-causal `tril(blocks)` mask on that grid.)
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
PROMPT = [11, 4242, 90001]
BLOCK = 2


def twin_reference(name: str, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if "qwen3" in FAMILIES[name].model_types.values():
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
    raw["model_type"] = next(iter(FAMILIES[name].model_types))
    if name == "dllm_bd3lm":
        raw["mask_token_id"] = DLLM_MASK  # (what its tokenizer's mask token would give)
    (src / "config.json").write_text(json.dumps(raw))
    dst = directory / f"{name}-clover"
    convert(name, src, dst)
    return reference, dst


@pytest.fixture(scope="module", params=sorted(PUBLISHED))
def twin(request, tmp_path_factory) -> tuple[str, torch.nn.Module, CloverForBlockDiffusion]:
    reference, path = released_twin(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, reference, CloverForBlockDiffusion.from_pretrained(path)


def reference_decode(reference: torch.nn.Module, shift: bool, mask_id: int, blocks: int = 2) -> list[int]:
    """Block decoding with the transformers model under HAND_MASK, one token a step (the most confident masked
    position), recomputing the whole sequence every step."""
    seq = list(PROMPT)
    for _ in range(blocks):
        block = [mask_id] * BLOCK
        while mask_id in block:
            x = torch.tensor([seq + block])
            n = x.shape[1]
            with torch.no_grad():
                logits = reference(x, attention_mask=HAND_MASK[:n, :n][None, None]).logits[0].float()
            logits[:, mask_id] = float("-inf")
            start = len(seq)
            rows = [start + p - 1 if shift else start + p for p in range(BLOCK)]
            probs = logits[rows].softmax(-1)
            conf, tokens = probs.max(-1)
            conf[torch.tensor(block) != mask_id] = -1.0
            p = int(conf.argmax())
            block[p] = int(tokens[p])
        seq += block
    return seq[len(PROMPT):]


def first_step_predictions(model: CloverForBlockDiffusion) -> torch.Tensor:
    """The engine's predictions for the first block's positions, `[B, V]` (the prefill's last forward)."""
    engine = Engine(model, block_size=BLOCK, threshold=1.0, eos_token_ids=[])
    seqs = engine.make_sequences([PROMPT], 2 * BLOCK, SamplingParams())
    with torch.inference_mode():
        return engine._prefill(seqs).logits[0].float()


def reference_first_step(reference: torch.nn.Module, shift: bool, mask_id: int) -> torch.Tensor:
    x = torch.tensor([PROMPT + [mask_id] * BLOCK])
    with torch.no_grad():
        logits = reference(x, attention_mask=HAND_MASK[:5, :5][None, None]).logits[0].float()
    return logits[[2, 3]] if shift else logits[[3, 4]]


def test_conversion_records_the_published_conventions(twin) -> None:
    name, _, model = twin
    config, published = model.config, PUBLISHED[name]
    assert (config.family, config.mask_token_id, config.block_size, config.token_shift) == (
        name, published["mask"], published["block"], published["shift"])
    assert (config.context_reading, config.prompt_reading) == ("block_causal", "blocks")


def test_block_size_one_equals_the_ar_reference(twin) -> None:
    _, reference, model = twin
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids, block_size=1).logits - reference(ids).logits).abs().max().item()
    assert diff < 1e-4


def test_block_decoding_equals_the_hand_written_mask(twin) -> None:
    name, reference, model = twin
    expected = reference_decode(reference, model.config.token_shift, model.config.mask_token_id)
    got = generate(model, [PROMPT], 2 * BLOCK, block_size=BLOCK, threshold=1.0, eos_token_ids=[]).sequences[0]
    assert got == expected
    want = reference_first_step(reference, model.config.token_shift, model.config.mask_token_id)
    assert torch.allclose(first_step_predictions(model), want, atol=1e-4)


SWAPS = {
    "token_shift": lambda c: dict(token_shift=not c.token_shift),
    "prompt_reading": lambda c: dict(prompt_reading="causal"),
    "context_reading": lambda c: dict(prompt_reading="causal", context_reading="causal"),
    "mask_id": lambda c: dict(mask_token_id=c.mask_token_id - 1),
}


@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_a_swapped_convention_breaks_the_equality(twin, swap: str) -> None:
    _, reference, model = twin
    true = model.config
    want = reference_first_step(reference, true.token_shift, true.mask_token_id)
    swapped = dataclasses.replace(true, **SWAPS[swap](true))
    original, model.config = model.config, swapped
    try:
        got = first_step_predictions(model)
    finally:
        model.config = original
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
    _, _, model = twin
    prompts = [PROMPT, [5, 6, 7, 8, 9, 10], [42]]
    together = generate(model, prompts, 2 * BLOCK, block_size=BLOCK, eos_token_ids=[]).sequences
    alone = [generate(model, [p], 2 * BLOCK, block_size=BLOCK, eos_token_ids=[]).sequences[0] for p in prompts]
    assert together == alone


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
    assert (info["family"], info["token_shift"], info["prompt_reading"]) == (name, PUBLISHED[name]["shift"], "blocks")
    can = {c["what"]: c["can"] for c in info["can"]}
    assert can["exact mode (rule 'exact')"] is PUBLISHED[name]["shift"]
    assert can["prefix reuse in the server"] is False
    assert main(["info", str(target)]) == 0
    assert FAMILIES[name].title in capsys.readouterr().out
