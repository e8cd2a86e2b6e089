"""Released block-diffusion checkpoints (SDAR, Fast-dLLM v2, dllm's A2D / BD3LM) -> Clover checkpoints.

Each is its Qwen base's tensor layout (clover.conversion.qwen) under its own `model_type`; the conversion copies the
tensors, keeps the family's mask token and row, and records the family's conventions (token shift, context and
prompt reading, block size, threshold: clover.conversion.families) in the Clover config.
"""

from __future__ import annotations

from pathlib import Path

from clover.conversion.common import read_hf_dir
from clover.conversion.families import FAMILIES, apply_family, family_mask_id
from clover.conversion.qwen import QwenSource


class ReleasedSource(QwenSource):
    def __init__(self, src: Path, family_name: str) -> None:
        family = FAMILIES[family_name]
        raw, _ = read_hf_dir(src)
        model_type = raw.get("model_type")
        if model_type not in family.model_types:
            raise ValueError(f"{src}/config.json has model_type {model_type!r}; --from {family.name} expects one of "
                             f"{sorted(family.model_types)} ({family.title})")
        super().__init__(src, family.model_types[model_type], released=model_type)
        self.mask_token_id = family_mask_id(family, self.tokenizer(), raw, self.config.vocab_size, src)
        self.config = apply_family(self.config, family, self.mask_token_id)


def open_source(src: Path, family_name: str) -> ReleasedSource:
    return ReleasedSource(src, family_name)
