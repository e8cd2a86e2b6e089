"""The released block-diffusion families Clover loads, each with the conventions its own code uses.

A family's checkpoint is a Qwen-form model (Qwen3: q/k norms; Qwen3-MoE; Qwen2.5: q/k/v biases; the Qwen3.5 hybrid)
in its base's tensor layout; what makes it a block-diffusion model is how it is *read*, recorded in `CloverConfig` so
that the engine, every decoding rule, decision mode and the server run it:

* `token_shift`: whether a masked position is predicted from the output one to its left (the AR convention) or at
  its own position;
* `context_reading`: committed blocks read block-causally (BD3-LM's clean stream) or causally;
* `prompt_reading`: the prompt read causally, or on the block grid ("blocks");
* `block_grid`: where that grid lies: ending where the prompt ends, or at absolute positions 0, B, 2B, ... (the
  prompt's last partial block then opens the first generated block);
* `deltanet_reading` (hybrids): Gated DeltaNet layers read a block in both directions (Clover) or causally;
* the mask token and the default block size / threshold.

What each family does, and where it was read (docs/families.md has the table and how each was checked):

* **SDAR** (JetAstra/SDAR `generate.py`; SGLang `SDARForCausalLM` / `SDARMoeForCausalLM`): Qwen3 layout,
  `model_type` "sdar" (the MoE variant: Qwen3-MoE layout, "sdar_moe"), mask `<|MASK|>` = 151669, block 4; blocks
  read block-causally (a block attends to itself and every block before it), a masked position predicted at its
  own position (no shift); the prompt is read on the block grid.
* **Fast-dLLM v2** (its `modeling.py` on the Hub: `eval_block_diff_mask`, `generate`): Qwen2.5 layout,
  `model_type` "Fast_dLLM_Qwen", mask 151665, block (`bd_size`) 32 decoded in sub-blocks of 8 (the `sub_blocks`
  rule: `threshold` inside the leftmost sub-block with masks), threshold 0.9;
  block-causal, with the token shift (`logits = cat(logits[:, :1], logits[:, :-1])`; a block's first token is the
  committed block's last output).
* **dllm BD3LM / A2D** (ZHZisZZ/dllm `core/samplers/bd3lm.py`, `pipelines/a2d`): the AR base's layout under
  `model_type` "a2d-qwen3" / "a2d-qwen2", the tokenizer's mask token, block 32; the staircase mask (block-causal),
  no shift (`right_shift_logits` False), the prompt left-padded to whole blocks.
* **arcLM** (its model card: Qwen3.5-0.8B converted to BD3LM, block 64): the Qwen3.5 hybrid's layout; attention
  layers read a block in both directions and committed blocks block-causally, Gated DeltaNet layers stay the AR
  base's causal recurrence (`deltanet_reading` "causal"); BD3LM's conventions otherwise (no shift, the prompt on
  the block grid, the tokenizer's mask token). Its released files were not reachable offline: Clover accepts the
  base's own `model_type` ("qwen3_5", "qwen3_5_text") and dllm's A2D naming ("a2d-qwen3_5") under `--from arclm`.

SDAR's and Fast-dLLM v2's own generators place the block grid at position 0, so a prompt's last partial block is
completed by the first generated tokens (`block_grid` "absolute"); dllm's sampler ends the grid where the prompt ends,
and generation starts a fresh block ("prompt_end").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover.config import CloverConfig
from clover.conversion.gguf_export import check_exportable


@dataclass(frozen=True)
class Family:
    name: str  # `clover convert --from NAME`, `CloverConfig.family`
    title: str
    model_types: dict[str, str]  # config.json `model_type` of its released checkpoints -> the base's tensor layout,
    # "qwen3" (q/k norms), "qwen3_moe" (Qwen3 with routed experts) or "qwen2" (q/k/v biases)
    token_shift: bool
    context_reading: str
    prompt_reading: str
    block_size: int
    threshold: float
    mask_token_id: int | None  # the published id (None: the tokenizer's mask token)
    source: str  # where the conventions were read
    block_grid: str = "prompt_end"  # where the grid of a "blocks" prompt lies
    deltanet_reading: str = "block_bidirectional"  # hybrids only: how Gated DeltaNet layers read a block
    rule: str = "threshold"  # its generator's schedule (clover.engine.decoding)

    def conventions(self) -> dict[str, Any]:
        return {"family": self.name, "token_shift": self.token_shift, "context_reading": self.context_reading,
                "prompt_reading": self.prompt_reading, "block_grid": self.block_grid,
                "deltanet_reading": self.deltanet_reading, "block_size": self.block_size,
                "threshold": self.threshold, "rule": self.rule}


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("sdar", "SDAR (JetAstra)", {"sdar": "qwen3", "sdar_moe": "qwen3_moe"}, token_shift=False, context_reading="block_causal",
           prompt_reading="blocks", block_size=4, threshold=0.85, mask_token_id=151669,
           source="JetAstra/SDAR generate.py; SGLang models/sdar.py", block_grid="absolute"),
    Family("fast_dllm_v2", "Fast-dLLM v2 (NVlabs)", {"Fast_dLLM_Qwen": "qwen2"}, token_shift=True,
           context_reading="block_causal", prompt_reading="blocks", block_size=32, threshold=0.9,
           mask_token_id=151665, source="Efficient-Large-Model/Fast_dLLM_v2_* modeling.py (generate, eval mask)",
           block_grid="absolute", rule="sub_blocks"),
    Family("dllm_bd3lm", "dllm BD3LM / A2D (ZHZisZZ/dllm)", {"a2d-qwen3": "qwen3", "a2d-qwen2": "qwen2"},
           token_shift=False,
           context_reading="block_causal", prompt_reading="blocks", block_size=32, threshold=0.9,
           mask_token_id=None, source="ZHZisZZ/dllm core/samplers/bd3lm.py, pipelines/a2d"),
    Family("arclm", "arcLM (Qwen3.5 hybrid BD3LM)", {"a2d-qwen3_5": "qwen3_5", "qwen3_5": "qwen3_5",
                                                     "qwen3_5_text": "qwen3_5"},
           token_shift=False, context_reading="block_causal", prompt_reading="blocks", block_size=64, threshold=0.9,
           mask_token_id=None, deltanet_reading="causal",
           source="its model card's description (BD3LM from Qwen3.5-0.8B, block 64, attention bidirectional inside "
                  "a block, Gated DeltaNet causal); dllm's BD3LM conventions; the released files were not reachable"),
)}

# Clover's own convention, for `clover info` on its checkpoints
CLOVER = {"family": "clover", "token_shift": True, "context_reading": "block_causal or causal (per checkpoint)",
          "prompt_reading": "causal"}


def capabilities(config: CloverConfig) -> list[tuple[str, bool, str]]:
    """What Clover can and cannot do with a model of these conventions: `(what, can, why)`."""
    shift = config.token_shift
    out = [
        ("block decoding (every block rule, the server)", config.mask_token_id is not None,
         "mask token id %s" % config.mask_token_id),
        ("exact mode (rule 'exact')", shift,
         "drafts are verified against the causal path, block-size-1 decoding reading every token causally"
         if shift else "undefined: without the token shift no output at a committed token predicts the next one"),
        ("decision mode (decide)", config.mask_token_id is not None,
         "slot position p read from output p - 1" if shift else "slot position p read from output p"),
        ("decide_autoregressive", shift, "reads each token from the output before it" if shift
         else "undefined without the token shift"),
        ("prefix reuse in the server", config.prompt_reading == "causal",
         "prompts read causally" if config.prompt_reading == "causal"
         else "a prompt on the block grid is padded to whole blocks; no cached prefix lines up"),
    ]
    try:
        check_exportable(config)
        out.append(("GGUF export (llama.cpp runner)", True, "dense attention model with Clover's conventions"))
    except ValueError as e:
        out.append(("GGUF export (llama.cpp runner)", False, str(e).removeprefix("cannot export to GGUF: ")))
    return out


def apply_family(config: CloverConfig, family: Family, mask_token_id: int) -> CloverConfig:
    """`config` (the base's, from its config.json) with the family's conventions and mask token."""
    return dataclasses.replace(config, mask_token_id=mask_token_id, **family.conventions())


def family_mask_id(family: Family, tokenizer: Any | None, raw: dict[str, Any], vocab_size: int, src: Path) -> int:
    """The mask id: the tokenizer's mask token, else config.json's `mask_token_id`, else the published id."""
    candidates = [
        ("the tokenizer's mask token", getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None),
        ("config.json mask_token_id", raw.get("mask_token_id")),
        (f"{family.title}'s published mask id", family.mask_token_id),
    ]
    for where, mask_id in candidates:
        if mask_id is not None:
            if not 0 <= int(mask_id) < vocab_size:
                raise ValueError(f"{src}: {where} is {mask_id}, outside the vocabulary of {vocab_size} rows")
            return int(mask_id)
    raise ValueError(f"{src}: no mask token (the tokenizer has none and config.json sets no mask_token_id); "
                     f"a {family.title} checkpoint needs the one it was trained with")
