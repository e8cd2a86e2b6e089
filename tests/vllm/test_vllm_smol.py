"""clover-smol, the default model, on vLLM (`clover serve --engine vllm`, no --model): greedy chat answers equal
`clover generate --quant none --block-size 1` (fp32) token for token on held-out prompts. Slow (vLLM's start and
48 tokens per prompt on 2 cores): `pytest -m slow tests/vllm/test_vllm_smol.py`."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI
from vllm_helpers import greedy_matches, needs_vllm, vllm_server

from clover import CloverForBlockDiffusion
from clover.cli.loading import resolve_model_dir
from clover.tokenizer import load_tokenizer

pytestmark = [pytest.mark.slow, needs_vllm]

# held out: written for this test, in no training or evaluation set of the project
PROMPTS = ["Name three rivers in Europe.", "What does a compiler do?", "Write a haiku about autumn rain.",
           "How many legs does a spider have?", "Give one tip for learning to cook.",
           "What is the capital of Canada?", "Explain what a prime number is.", "Suggest a name for a grey cat."]
MAX_TOKENS = 48


def test_clover_smol_on_vllm_equals_block_size_1(tmp_path) -> None:
    directory = resolve_model_dir(None, "none")
    tokenizer = load_tokenizer(directory)
    model = CloverForBlockDiffusion.from_pretrained(directory, dtype=torch.float32)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    prompts = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
               for c in chats]
    want = model.generate(prompts, max_new_tokens=MAX_TOKENS, block_size=1).sequences
    with vllm_server(None, tmp_path / "vllm.log", "--dtype", "float32", "--", "--enforce-eager",
                     name="clover-smol") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        for chat, prompt, expected in zip(chats, prompts, want):
            out = client.chat.completions.create(model="clover-smol", messages=chat, max_tokens=MAX_TOKENS,
                                                 temperature=0, extra_body={"return_token_ids": True})
            assert out.model_extra["prompt_token_ids"] == prompt
            got = out.choices[0].model_extra["token_ids"]
            assert greedy_matches(got, expected, model.config.eos_token_id), (chat, got, expected)
