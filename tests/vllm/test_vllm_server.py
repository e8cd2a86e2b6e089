"""`clover serve --engine vllm` (vLLM's OpenAI server, from .venv-vllm) on a random Clover checkpoint: greedy
tokens equal Clover's block size 1 in float32, prompts and chats with tools rendered by the checkpoint's own
template. Slow (vLLM starts in ~1-2 minutes on 2 cores): `pytest -m slow tests/vllm`."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI
from server_helpers import build_checkpoint
from vllm_helpers import greedy_matches, needs_vllm, vllm_server

from clover import CloverForBlockDiffusion

pytestmark = [pytest.mark.slow, needs_vllm]

# held out: none of them was used to build or check the mapping
PROMPTS = [[5, 17, 3, 99, 42, 7, 11], [8, 120], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [300, 12, 77],
           [9, 9, 9, 9, 9], [250, 4, 180, 33, 71, 2], [101], [42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, chat_tokenizer):
    directory = build_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-dense", chat_tokenizer,
                                 "clover-tiny-dense", head_dim=32)  # vLLM's CPU attention: head_dim >= 32
    model = CloverForBlockDiffusion.from_pretrained(directory, dtype=torch.float32)
    with vllm_server(directory, directory.parent / "vllm.log", "--dtype", "float32") as url:
        yield model, OpenAI(base_url=f"{url}/v1", api_key="none")


def test_completions_greedy_equal_block_size_1(served) -> None:
    model, client = served
    want = model.generate(PROMPTS, max_new_tokens=16, block_size=1).sequences
    for prompt, expected in zip(PROMPTS, want):
        out = client.completions.create(model="clover-test", prompt=prompt, max_tokens=16, temperature=0,
                                        extra_body={"return_token_ids": True})
        got = out.choices[0].model_extra["token_ids"]
        assert greedy_matches(got, expected, model.config.eos_token_id), (prompt, got, expected)


def test_chat_with_tools_renders_the_checkpoints_template_and_decodes_greedily(served, chat_tokenizer) -> None:
    model, client = served
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = chat_tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    (expected,) = model.generate([list(prompt)], max_new_tokens=16, block_size=1).sequences
    out = client.chat.completions.create(model="clover-test", messages=messages, tools=TOOLS, tool_choice="auto",
                                         max_tokens=16, temperature=0,
                                         extra_body={"return_token_ids": True, "skip_special_tokens": False})
    assert out.model_extra["prompt_token_ids"] == list(prompt)  # vLLM rendered the same template with the tools
    assert out.usage.prompt_tokens == len(prompt)
    assert greedy_matches(out.choices[0].model_extra["token_ids"], expected, model.config.eos_token_id)
