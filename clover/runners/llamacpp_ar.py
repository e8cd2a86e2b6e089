"""llama.cpp's plain autoregressive greedy decoding of a GGUF: one sequence, causal attention, one token a decode.

The baseline the benchmarks compare Clover with (llama.cpp's own generation on the same GGUF and token ids), and
the check that an export is a standard llama.cpp model. No sequence-id masks, no blocks: what any llama.cpp
program does (`llama-cli`'s loop with the greedy sampler; argmax here, which picks the same first maximum).

    decoder = LlamaCppAR("model-q8_0.gguf", threads=2)
    for token in decoder.generate(prompt_ids, max_new=64, eos=(2,)): ...
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterator
from pathlib import Path

import numpy as np

from clover.runners import llama_api


class LlamaCppAR:
    """A GGUF in its own llama.cpp context of `n_ctx` cells; prompts are decoded in chunks of `n_batch` tokens."""

    def __init__(self, path: str | Path, *, threads: int, n_ctx: int = 4096, n_batch: int = 512) -> None:
        lib = self._lib = llama_api.load()
        lib.llama_log_set(llama_api.quiet_log(), None)
        self._model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_threads = params.n_threads_batch = threads
        self._ctx = lib.llama_init_from_model(self._model, params)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} cells for {path}")
        self._memory = lib.llama_get_memory(self._ctx)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        self.n_ctx, self.n_batch = n_ctx, n_batch
        self._batch = lib.llama_batch_init(n_batch, 0, 1)
        self._finalizer = weakref.finalize(self, llama_api.free_all, lib, self._batch, self._ctx, self._model)

    def generate(self, prompt: list[int], max_new: int, eos: Collection[int] = ()) -> Iterator[int]:
        """Greedy tokens after `prompt` (the KV cache cleared first: nothing reused between calls), until a token
        of `eos` (not yielded) or `max_new` tokens."""
        if not prompt or len(prompt) + max_new > self.n_ctx:
            raise ValueError(f"a prompt of 1 to {self.n_ctx - max_new} tokens is needed for {max_new} new tokens "
                             f"in {self.n_ctx} cells; got {len(prompt)}")
        self.prefill(prompt)
        for i in range(max_new):
            logits = np.ctypeslib.as_array(self._lib.llama_get_logits(self._ctx), shape=(self.n_vocab,))
            token = int(logits.argmax())
            if token in eos:
                return
            yield token
            if i + 1 < max_new:
                self.decode([token], len(prompt) + i)

    def prefill(self, prompt: list[int]) -> None:
        """Clear the KV cache and decode `prompt` in chunks of `n_batch`, keeping the last token's logits."""
        self.truncate(0)
        for start in range(0, len(prompt), self.n_batch):
            self.decode(prompt[start:start + self.n_batch], start, last=start + self.n_batch >= len(prompt))

    def truncate(self, length: int) -> None:
        """Forget the cached positions from `length` on."""
        self._lib.llama_memory_seq_rm(self._memory, 0, length, -1)

    def decode(self, tokens: list[int], start: int, last: bool = True) -> None:
        """Tokens at positions `start...` of sequence 0, after the cached ones; the last one's logits kept if
        `last`."""
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, start + i, 1, 0
            batch.seq_id[i][0] = 0
        batch.logits[len(tokens) - 1] = last
        rc = self._lib.llama_decode(self._ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")

    def close(self) -> None:
        self._finalizer()
