"""Released block-diffusion checkpoints (SDAR, Fast-dLLM v2, dllm's A2D / BD3LM, arcLM) -> Clover checkpoints.

Each is its Qwen base's tensor layout (clover.conversion.qwen, clover.conversion.qwen3_5) under its own
`model_type`; the conversion copies the tensors, keeps the family's mask token and row, and records the family's
conventions (token shift, context / prompt / DeltaNet reading, block size, threshold: clover.conversion.families)
in the Clover config.
"""

from __future__ import annotations

from pathlib import Path

from clover.conversion.common import HFSource, read_hf_dir
from clover.conversion.families import FAMILIES, apply_family, family_mask_id
from clover.conversion.qwen import QwenSource
from clover.conversion.qwen3_5 import Qwen35Source


def open_source(src: Path, source_format: str) -> HFSource:
    """`--from sdar | fast_dllm_v2 | dllm_bd3lm | arclm`: the family's checkpoint."""
    family = FAMILIES[source_format]
    raw, _ = read_hf_dir(src)
    model_type = raw.get("model_type")
    if model_type not in family.model_types:
        raise ValueError(f"{src}/config.json has model_type {model_type!r}; --from {family.name} expects one of "
                         f"{sorted(family.model_types)} ({family.title})")
    layout = family.model_types[model_type]
    source_class = Qwen35Source if layout == "qwen3_5" else QwenSource
    source = source_class(src, layout, released=model_type)
    source.mask_token_id = family_mask_id(family, source.tokenizer(), raw, source.config.vocab_size, src)
    source.config = apply_family(source.config, family, source.mask_token_id)
    return source
