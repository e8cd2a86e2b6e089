"""A decoding loop: what the engine does between a prompt's prefill and its last token, as one small class.

The engine (engine.py) owns what every loop shares: validating requests, the prefill's chunks, continuous
batching (requests prefilled alone, then joining a running batch), the runner call and emission. A loop owns its
batch type and the step: `BlockLoop` (block_loop.py) denoises a block in steps chosen by an unmasking rule and
commits it; `ExactLoop` (exact.py) verifies drafts against the causal path, a forward at a time. The rule's type
picks the loop, once, when the engine is made: the engine never checks which loop it runs.

    check(params)              refuse requests the loop cannot serve (before anything runs)
    open(seqs, ids, cache, **kw)  the prefill's last chunk -> a batch at its first step (`kw`, `prompt=True`
                               among them, go to the forward that reads it)
    step(batch)                -> events, the batch (None once every request finished)
    at_boundary(batch)         whether requests can join now
    join(a, b) / keep_rows     batches merge; finished or cancelled rows leave
    room(context, prompt)      how many new tokens fit (one rule for the engine and the server)
    prompt_grid                the block grid the prefill reads prompts on (1: causally)
    prefilled(prompt)          the part of a prompt the prefill reads (the rest opens the first block)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from clover.engine.constraints.repetition import BreakerCache
from clover.engine.drafts.draft_memory import DraftMemory
from clover.engine.logprobs import TokenLogprob
from clover.engine.request import Detokenize, RequestOptions, Sequence
from clover.engine.runner import ModelRunner, RunnerCache


@dataclass
class StreamPiece:
    """The committed tokens of one block of one request (what a streaming client appends)."""

    seq_id: int  # its sequence's: the request's position in the prompts given to the engine (or its id)
    token_ids: list[int]
    block: int
    finished: bool = False
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None  # on a request's last piece
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids`, when the request asked for them


@dataclass
class StepSnapshot:
    """The state of a block after one denoising step (for visualisation)."""

    seq_id: int  # as `StreamPiece.seq_id`
    block: int
    step: int  # 1-based within the block
    tokens: list[int | None]  # None: still masked
    new: list[bool]  # filled in this step


Event = StreamPiece | StepSnapshot


class Run(Protocol):
    """Work that is stepped to its end and then read whole, beside the decoding batches: a decision run
    (clover.engine.loops.decision) or a prompt scoring (clover.engine.logprobs). The server's scheduler steps every run
    it holds through these three names, on the thread that runs the model."""

    prompts: list[list[int]]  # its rows (what it holds of the runner while it runs)

    def step(self) -> bool:
        """One step (a forward, or a prompt's chunked forwards); True once the run is done."""

    def results(self) -> list[Any]:
        """One result per prompt, once done."""


@dataclass
class EngineCounters:
    """Batch-level figures, for benchmarks: engine overhead = wall time - forward time."""

    forwards: int = 0
    forward_time_s: float = 0.0
    steps: int = 0


class LoopEngine(Protocol):
    """What a loop may ask of the engine that drives it (clover.engine.engine.Engine): the runner call, emission
    and the settings every loop shares."""

    runner: ModelRunner
    device: torch.device
    block_size: int
    mask_id: int
    vocab_size: int
    banned_ids: torch.Tensor  # ids never emitted (the mask, past the vocabulary limit)
    eos: torch.Tensor  # `eos_ids` as a tensor
    eos_ids: list[int]
    causal_context: bool  # the model reads committed context causally (its config's `context_reading`)
    detokenize: Detokenize | None
    breakers: BreakerCache | None  # DRY's sequence breakers by token
    memory: DraftMemory | None  # the drafting memory, where the rule drafts from one
    counters: EngineCounters

    def forward(self, ids: torch.Tensor | None, cache: RunnerCache, block_size: int | None = None,
                **kwargs: Any) -> torch.Tensor:
        """The runner's logits for one forward, timed and counted."""

    def masks(self, n: int, width: int | None = None) -> torch.Tensor:
        """`[n, width]` mask ids (width: the block size)."""

    def eos_of(self, seq: Sequence) -> list[int]:
        """The ids that end `seq`."""

    def heeds_eos(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """`[N]` bool: the rows an engine EOS ends (None when all do)."""

    def emit(self, b: Any, pieces: list[tuple[list[int], int, int]],
             logprobs: list[list[TokenLogprob | None] | None] | None = None) -> list[Event]:
        """Row `r` of batch `b` takes `pieces[r]` (its tokens, steps, forwards); finished rows leave `b`."""


class DecodingLoop:
    """The interface of a loop (module docstring); `engine` gives it the runner call, emission and settings."""

    name: ClassVar[str] = ""
    prompt_grid: int = 1

    def __init__(self, engine: LoopEngine) -> None:
        self.engine = engine

    def check(self, options: list[RequestOptions]) -> None:
        """Raise `ValueError` naming the request whose options this loop cannot serve."""

    def calibrate(self, defer: bool = False) -> None:
        """Measure what the loop needs of the runner before its first request (exact mode: the forward cost table),
        on the thread that runs the model and before any cache takes the runner's rows; `defer`: a stand-in now,
        the measurement at the first `idle` moment."""

    def idle(self) -> None:
        """Work deferred to a moment without requests (exact mode: measuring the cost table on first use)."""

    def prefilled(self, prompt: list[int]) -> list[int]:
        """The part of `prompt` the prefill reads: all of it, unless the loop opens its first block with the rest."""
        return prompt

    def open(self, seqs: list[Sequence], ids: torch.Tensor, cache: RunnerCache, **kwargs: Any) -> Any:
        raise NotImplementedError

    def step(self, b: Any, snapshots: bool = False) -> tuple[list[Event], Any]:
        raise NotImplementedError

    def at_boundary(self, b: Any) -> bool:
        raise NotImplementedError

    def join(self, b: Any, new: Any) -> Any:
        raise NotImplementedError

    def keep_rows(self, b: Any, keep: list[int]) -> None:
        raise NotImplementedError

    def room(self, context: int, prompt_len: int, block_size: int) -> tuple[int, str]:
        """New tokens that fit after a prompt of `prompt_len` in `context` positions, and why no more (the unit
        the positions are spent in)."""
        raise NotImplementedError

    def figures(self) -> dict[str, Any]:
        """What the loop chose, for `--json` and the server (the decoding settings it ran with)."""
        return {}
