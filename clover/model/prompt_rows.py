"""Whether a forward reads prompt tokens, for the layers whose arithmetic would otherwise depend on how many rows
share it: a prompt's cache must have the same bits alone, batched, or resumed from a stored prefix.

The model's forward sets it around its layers (`forward(..., prompt=True)`, passed on by the runner:
`clover.engine.runner.ModuleRunner`); the layers read it: an int8 / int4 layer that rounds its input twice
(clover.model.quant) multiplies prompt rows as `prompt_matmul()` says, the fused C++ layers (clover.model.fused) take
one path for prompt rows however many, and a DeltaNet layer (clover.model.deltanet) reads prompt chunks with the
chunked rule however short.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

PROMPT_MATMULS = ("kernel", "fp32")  # how prompt rows multiply (`prompt_matmul`)
_READING_PROMPT: ContextVar[bool] = ContextVar("clover_reading_prompt", default=False)


@contextmanager
def reading_prompt(reading: bool = True) -> Iterator[None]:
    """Forwards inside read prompt tokens (prefill chunks, and the forward that carries the last one with the first
    query block): there an int8 / int4 layer that rounds its input twice (`int8x2`) multiplies as `prompt_matmul()`
    says. Which path a row takes depends only on whether it is a prompt token, never on how many rows share its
    forward: so the linear layers of exact mode's first forward, which may carry query rows beside the prompt's last
    chunk, compute the prompt's rows as block size 1's do, a batch and a resumed prefix
    (clover.serving.scheduling.prefix_cache) as one request does, and decoding steps of any batch size run the kernel.
    For the same reason prompt forwards take one path through a layer however many rows they have: the fused C++ layer
    (clover.model.fused) with the kernel, the modules with `fp32`. `reading=False` inside: not (the LM head, which
    reads only the few rows kept for logits)."""
    token = _READING_PROMPT.set(reading)
    try:
        yield
    finally:
        _READING_PROMPT.reset(token)


def is_reading_prompt() -> bool:
    return _READING_PROMPT.get()


def prompt_matmul() -> str:
    """How prompt rows of a layer that rounds its input twice multiply (`reading_prompt`): `$CLOVER_PROMPT_MATMUL`,
    one of `PROMPT_MATMULS`. `kernel` (the default): the integer kernel that decoding steps run, so every row of a
    request is computed alike, and alike on every x86 CPU (its AVX2 and AVX-512 VNNI tiles give the same bits); with
    VNNI it is faster than torch's fp32 matmul at every row count. `fp32`: the weights dequantised for one fp32
    matmul of the unrounded rows, for a CPU with AVX2 alone and prompts of thousands of tokens, where it is ~1.3x
    the kernel's speed, but slower below several hundred, where dequantising every weight dominates (docs/cpu.md,
    "Prompt rows")."""
    choice = os.environ.get("CLOVER_PROMPT_MATMUL", "kernel")
    if choice not in PROMPT_MATMULS:
        raise ValueError(f"CLOVER_PROMPT_MATMUL must be one of {', '.join(PROMPT_MATMULS)}; got {choice!r}")
    return choice
