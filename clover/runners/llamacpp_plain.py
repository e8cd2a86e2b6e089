"""The llama.cpp runner for a plain autoregressive GGUF: a file without Clover's metadata, as llama.cpp's own
`convert_hf_to_gguf.py` writes it (Llama, Qwen2.5, Qwen3, Qwen3.5, ... : any architecture llama.cpp runs).

    runner = LlamaCppFile.open("Qwen3-0.6B-Q8_0.gguf", options)   # picks this class for a file without Clover's keys
    generate(runner, prompts, block_size=1)                          # or rule="exact": block size 1's answers

An AR model has no masked block to draft with, so it runs the causal path exactly as a hybrid GGUF does
(`clover.runners.llamacpp_hybrid`, whose forward and rewind it shares): block size 1, and exact mode verifying
drafts copied from the request's context and the drafting memory. The file's own chat template and tokenizer come
with it (`gguf_tokenizer`), and with them its tool-call format (`clover.tool_formats.detect`). Its shape is read
from the file's metadata (`clover.conversion.gguf.plain_gguf_config`), with a mask id one past the vocabulary that
is never fed and never emitted. Attention-only files rewind by cutting the sequence's cells; a file with recurrent
layers (`{arch}.ssm.*` metadata: Qwen3.5, Qwen3-Next) by llama.cpp's rollback snapshots, as a hybrid GGUF does.
"""

from __future__ import annotations

from typing import Any

from clover.config import CloverConfig
from clover.conversion.gguf import gguf_tokenizer, plain_gguf_config
from clover.conversion.gguf_header import read_header
from clover.runners.llamacpp_hybrid import HybridLlamaCppRunner


class PlainLlamaCppRunner(HybridLlamaCppRunner):
    """A plain AR GGUF's causal path on llama.cpp (module docstring); the arguments are HybridLlamaCppRunner's."""

    def _read_config(self) -> CloverConfig:
        self._header = read_header(self.path)
        self.recurrent = f"{self._header.get('general.architecture')}.ssm.state_size" in self._header.metadata
        return plain_gguf_config(self._header, self.n_vocab)

    def _read_tokenizer(self) -> Any:
        return gguf_tokenizer(self.path, None)
