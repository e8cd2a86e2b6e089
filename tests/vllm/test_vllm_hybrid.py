"""A random hybrid twin (Gated DeltaNet + gated attention + MoE, right convs and memory calibration randomised) on
vLLM's CPU build, served as vLLM's Qwen3-Next model. Its CPU Gated DeltaNet kernel runs bfloat16 only ("CPU GDN
attention requires BF16") and value/key head dims of 128 (32 fails: "Unexpected head dim size"), so the twin has
those. Two bf16 implementations round differently, and where the model's own answer moves with bf16 rounding (Clover's
bf16 and fp32 answers part) vLLM's may move elsewhere; so vLLM must give Clover's tokens for as long as Clover's own
bf16 and fp32 answers agree. Slow: `pytest -m slow tests/vllm/test_vllm_hybrid.py`."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI
from server_helpers import build_checkpoint
from vllm_helpers import needs_vllm, vllm_server

from clover import CloverForBlockDiffusion

pytestmark = [pytest.mark.slow, needs_vllm]

PROMPTS = [[5, 17, 3, 99, 42, 7, 11], [8, 120], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [300, 12, 77]]


def test_hybrid_twin_on_vllm_equals_block_size_1_in_bf16(tmp_path, chat_tokenizer) -> None:
    directory = build_checkpoint(tmp_path / "tiny-hybrid", chat_tokenizer, "clover-tiny", head_dim=32,
                                 linear_key_head_dim=128, linear_value_head_dim=128)
    model = CloverForBlockDiffusion.from_pretrained(directory, dtype=torch.bfloat16)
    want = model.generate(PROMPTS, max_new_tokens=12, block_size=1).sequences
    fp32 = CloverForBlockDiffusion.from_pretrained(directory, dtype=torch.float32)
    robust = [next((i for i, (a, b) in enumerate(zip(w, f)) if a != b), min(len(w), len(f)))
              for w, f in zip(want, fp32.generate(PROMPTS, max_new_tokens=12, block_size=1).sequences)]
    assert sum(robust) >= 12  # the comparison covers tokens, not just empty prefixes
    with vllm_server(directory, tmp_path / "vllm.log", "--dtype", "bfloat16", "--", "--enforce-eager") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        for prompt, expected, n in zip(PROMPTS, want, robust):
            out = client.completions.create(model="clover-test", prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"return_token_ids": True})
            got = out.choices[0].model_extra["token_ids"]
            assert got[:n] == expected[:n], (prompt, n, got, expected)
