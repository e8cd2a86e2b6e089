"""Real models' chat templates (llama.cpp's `models/templates/`, fetched at test time): rendered as `transformers`
renders them, their tool-call format detected, and the calls they render parsed back to the same calls, typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from clover.assistant_output import parse_assistant_output
from clover.chat_template import opens_reasoning, render_chat
from clover.tokenizer import load_tokenizer
from clover.tool_formats import detect

FORMATS = {
    "Qwen3.5-4B.jinja": "qwen3_coder", "Qwen3-Coder.jinja": "qwen3_coder", "Qwen-Qwen3-0.6B.jinja": "hermes",
    "Qwen-Qwen2.5-7B-Instruct.jinja": "hermes", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama3_json", "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama3_json",
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "detailed": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer"}}, "units": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ARGS = {"city": "Paris", "days": 3, "detailed": True, "hours": [9, 12], "units": "C"}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}
USER = {"role": "user", "content": "Weather in Paris for 3 days?"}
CHAT = [{"role": "system", "content": "You are a weather bot."}, USER,
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"temp_c": 21}'},
        {"role": "assistant", "content": "It is 21 °C."}, {"role": "user", "content": "And in Rome?"}]
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>")


@pytest.fixture(scope="module")
def pair(chat_tokenizer, tmp_path_factory) -> tuple:
    directory = tmp_path_factory.mktemp("tokenizer")
    chat_tokenizer.save_pretrained(directory)
    return load_tokenizer(directory), PreTrainedTokenizerFast.from_pretrained(str(directory))


def _template(real_templates: Path, name: str) -> str:
    path = real_templates / name
    assert path.is_file(), f"{name} is not among llama.cpp's templates in {real_templates}"
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_format_a_template_writes_is_detected(real_templates, name):
    assert detect(_template(real_templates, name)).name == FORMATS[name]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_real_templates_render_as_transformers_renders_them(real_templates, pair, name):
    ours, ref = pair
    template = _template(real_templates, name)
    for thinking in (None, True, False):
        for messages, generation in ((CHAT, True), (CHAT[:3], False)):
            kwargs = {} if thinking is None else {"enable_thinking": thinking}
            assert render_chat(ours, messages, TOOLS, add_generation_prompt=generation, template=template,
                               **kwargs) == \
                render_chat(ref, messages, TOOLS, add_generation_prompt=generation, template=template, **kwargs)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_call_the_template_renders_parses_back_typed(real_templates, pair, name):
    """What follows the generation prompt in a rendered conversation is what the model writes: parsed in the
    template's format, it is the call it was rendered from, with JSON-typed arguments."""
    ours, _ = pair
    template = _template(real_templates, name)
    prompt = render_chat(ours, CHAT[:2], TOOLS, add_generation_prompt=True, enable_thinking=False, template=template)
    full = render_chat(ours, CHAT[:3], TOOLS, template=template)
    assert full.startswith(prompt)
    answer = full[len(prompt):]
    answer = answer[: min(answer.find(t) for t in END_OF_TURN if t in answer)]
    content, _, calls = parse_assistant_output(answer, thinking=opens_reasoning(prompt),
                                               tool_format=detect(template), schemas=SCHEMAS)
    assert content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", ARGS)]


def test_qwen35_thinks_unless_told_not_to(real_templates, pair):
    ours, _ = pair
    template = _template(real_templates, "Qwen3.5-4B.jinja")
    on = render_chat(ours, [USER], add_generation_prompt=True, template=template)
    off = render_chat(ours, [USER], add_generation_prompt=True, enable_thinking=False, template=template)
    assert opens_reasoning(on) and not opens_reasoning(off)
    assert on.endswith("<|im_start|>assistant\n<think>\n") and off.endswith("<think>\n\n</think>\n\n")
