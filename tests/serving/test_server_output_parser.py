"""The output parser gives the same result however the text is split (streamed or whole)."""

from __future__ import annotations

import json
import random

import pytest

from clover.assistant_output import OutputParser, parse_assistant_output
from clover.chat_template import render_chat

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALLS = [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
         {"function": {"name": "get_time", "arguments": {"tz": "CET", "n": [1, 2.5]}}}]

TEXTS = [
    "just text",
    "  padded answer \n\n",
    'Sure. <tool_call>{"name":"f","arguments":{"a":1}}</tool_call>\n<tool_call>\n{"name": "g", "arguments": '
    '"{\\"b\\": true}"}\n</tool_call><tool_call>\n{not json}\n</tool_call> tail',
    "A <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call> B",
    "<think>plan it</think>\n\nanswer",
    "before <think> unclosed reasoning",
    "<tool_call> unclosed call",
    "a < b and c <tool but not a tag <think",
    'x <tool_call> a <tool_call> {"name": "f", "arguments": {}} </tool_call> y',
]


def _stream(text: str, thinking: bool, tools: bool, rng: random.Random) -> tuple[str, str | None, list]:
    parser = OutputParser(thinking, tools)
    content, reasoning, calls, i = "", "", [], 0
    while i < len(text):
        j = i + rng.randint(1, 6)
        d = parser.feed(text[i:j])
        content, reasoning, calls, i = content + d.content, reasoning + d.reasoning, calls + d.tool_calls, j
    d = parser.finish()
    return content + d.content, (reasoning + d.reasoning) or None, calls + d.tool_calls


def _whole(text: str, thinking: bool | None, tools: bool = True) -> tuple[str, str | None, list]:
    content, reasoning, calls = parse_assistant_output(text, thinking, tools)
    return content, reasoning, [c["function"] for c in calls]


@pytest.mark.parametrize("thinking", [False, True])
def test_streamed_equals_whole(thinking):
    rng = random.Random(0)
    for text in TEXTS:
        want = _whole(text, thinking)
        # a whole text says itself whether it starts inside reasoning
        assert _whole(("<think>" if thinking else "") + text, None) == want, text
        for _ in range(20):
            assert _stream(text, thinking, True, rng) == want, text


def test_template_rendered_answers_round_trip(chat_tokenizer):
    """What the model is trained to write after the generation prompt parses back to the message."""
    chat = [{"role": "user", "content": "Weather in Paris?"}]
    rng = random.Random(1)
    for reasoning in ("Check the weather first.", None):
        for content, calls in (("Checking.", CALLS), ("", CALLS[:1]), ("It is sunny.", [])):
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            if reasoning:
                message["reasoning_content"] = reasoning
            thinking = reasoning is not None
            prompt = render_chat(chat_tokenizer, chat, TOOLS, add_generation_prompt=True, enable_thinking=thinking)
            full = render_chat(chat_tokenizer, chat + [message], TOOLS)
            generated = full[len(prompt):full.rindex("<|im_end|>")]
            for _ in range(10):
                got_content, got_reasoning, got_calls = _stream(generated, thinking, True, rng)
                assert (got_content, got_reasoning) == (content, reasoning)
                assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == \
                    [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_reasoning_streams_before_the_closing_tag_and_calls_only_when_complete():
    parser = OutputParser(thinking=True, tools=True)
    assert parser.feed("Let me think").reasoning == "Let me think"
    d = parser.feed(" more</thi")
    assert d.reasoning == " more" and not d.content
    d = parser.feed('nk>\n\nOk. <tool_call>\n{"name": "f", ')
    assert d.content == "Ok." and not d.tool_calls
    d = parser.feed('"arguments": {"x": 1}}\n</tool_call>')
    assert d.tool_calls == [{"name": "f", "arguments": '{"x": 1}'}] and not d.content


def test_without_tools_tool_call_text_is_content():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert _whole(text, False, tools=False) == (text, None, [])
