"""The output parser gives the same result however the text is split (streamed or whole), and streams tool calls
as they are written: for every format, the fragments of each call add up to the whole response's call, however
the engine's blocks cut the text (one character, several calls, or everything at once)."""

from __future__ import annotations

import json
import random

import pytest

from clover.assistant_output import OutputParser, parse_assistant_output, whole_calls
from clover.chat_template import render_chat
from clover.tool_formats import TOOL_FORMATS, CallDelta
from clover.tool_formats.qwen3_coder import END_PARAMETER, Qwen3CoderParser

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


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def _random_cuts(text: str, rng: random.Random, longest: int = 6) -> list[int]:
    cuts, at = [], 0
    while at < len(text):
        at += rng.randint(1, longest)
        cuts.append(at)
    return cuts


def _deltas(pieces: list[str], thinking: bool = False, tools: bool = True, fmt=TOOL_FORMATS["hermes"],
            schemas=None) -> tuple[str, str | None, list[CallDelta]]:
    parser = OutputParser(thinking, tools, fmt, schemas)
    content, reasoning, deltas = "", "", []
    for piece in pieces:
        d = parser.feed(piece)
        content, reasoning, deltas = content + d.content, reasoning + d.reasoning, deltas + d.tool_calls
    d = parser.finish()
    return content + d.content, (reasoning + d.reasoning) or None, deltas + d.tool_calls


def _stream(text: str, thinking: bool, tools: bool, rng: random.Random) -> tuple[str, str | None, list]:
    content, reasoning, deltas = _deltas(_pieces(text, _random_cuts(text, rng)), thinking, tools)
    return content, reasoning, whole_calls(deltas)


def _whole(text: str, thinking: bool | None, tools: bool = True, fmt=TOOL_FORMATS["hermes"],
           schemas=None) -> tuple[str, str | None, list]:
    content, reasoning, calls = parse_assistant_output(text, thinking, tools, fmt, schemas)
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


def test_reasoning_streams_before_the_closing_tag_and_a_call_as_it_is_written():
    parser = OutputParser(thinking=True, tools=True)
    assert parser.feed("Let me think").reasoning == "Let me think"
    d = parser.feed(" more</thi")
    assert d.reasoning == " more" and not d.content
    d = parser.feed('nk>\n\nOk. <tool_call>\n{"name": "f", ')
    assert d.content == "Ok." and not d.tool_calls
    d = parser.feed('"arguments": {"x": ')
    assert d.tool_calls == [CallDelta(0, name="f"), CallDelta(0, arguments='{"x": ')] and not d.content
    d = parser.feed('1}}\n</tool_')  # a partial end tag is held back, the arguments' end is not
    assert d.tool_calls == [CallDelta(0, arguments="1}", done=True)]
    assert not parser.feed("call>").tool_calls and not parser.finish()


# -- every format: the call streams, and its fragments add up to the whole response's call -----------------------
SCHEMAS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hours": {"type": "array"}}}}
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew <York>\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n</function>\n</tool_call>")
FORMAT_TEXTS = {
    "hermes": [
        'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "a \\" } ] <tool>", '
        '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
        '<tool_call>\n{"arguments": {"b": 1}, "name": "late"}\n</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": [1, {"b": null}]}, "extra": true}</tool_call> after',
        '<tool_call>\n{"name": "cut", "arguments": {"a": "unfinished',
    ],
    "qwen3_coder": [
        "Let me look. " + XML_CALL + "\n" + XML_CALL.replace("New <York>", "Rome"),
        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
        "<tool_call>\nnot a function\n</tool_call> text",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n<parameter=city>\nOs",
        '<tool_call>\n<function=get_weather>\n<parameter=city>\n\nSay "hi" \\ é\n<b>\t</parameter\n\n</parameter>\n'
        "<parameter=city>\nagain\n</parameter>\n</function>\n</tool_call>",
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris}", "days": 3}}; '
        '{"name": "get_time", "parameters": {"tz": "CET"}};{"parameters": {}, "name": "late"}',
        '{"name": "f", "parameters": {"a": 1}} and then some words',
        '{"parameters": {"a": 1}, "name": "g"}',
        '{"not": "a call"}',
        "A plain answer.",
        '{"name": "f", "parameters": {"a": 1}, "id": "x}"}',
    ],
}
FORMAT_CASES = [(name, i) for name, texts in FORMAT_TEXTS.items() for i in range(len(texts))]


def _check_call_deltas(deltas: list[CallDelta]) -> None:
    """Each call starts (its name) before any other delta of its own, calls start in index order, and each ends
    once, with its last delta."""
    started, ended = [], set()
    for d in deltas:
        if d.name is not None:
            assert d.index == len(started), deltas
            started.append(d.index)
        assert d.index in started and d.index not in ended, deltas
        if d.done:
            ended.add(d.index)
    assert ended == set(started), deltas


@pytest.mark.parametrize("fmt, case", FORMAT_CASES)
def test_every_chunking_streams_the_whole_responses_calls(fmt, case):
    """One character a block, every cut in two (inside tags, keys, values), random blocks, the whole text in one:
    the same content, reasoning and calls, fragments adding up to the whole response's arguments."""
    text, tool_format = FORMAT_TEXTS[fmt][case], TOOL_FORMATS[fmt]
    want = _whole(text, False, True, tool_format, SCHEMAS)
    rng = random.Random(case)
    chunkings = [[text], list(text), *(_pieces(text, [k]) for k in range(1, len(text))),
                 *(_pieces(text, _random_cuts(text, rng, 12)) for _ in range(20))]
    for pieces in chunkings:
        content, reasoning, deltas = _deltas(pieces, False, True, tool_format, SCHEMAS)
        _check_call_deltas(deltas)
        assert (content, reasoning, whole_calls(deltas)) == want, pieces


def test_the_formats_calls_parse_as_written():
    """What the whole responses hold: raw JSON arguments for the JSON formats (as the model wrote them), JSON built
    and typed by the schema for the XML format; text that is no call stays content."""
    def calls(fmt: str, i: int) -> tuple[str, list[tuple[str, str]]]:
        content, _, found = _whole(FORMAT_TEXTS[fmt][i], False, True, TOOL_FORMATS[fmt], SCHEMAS)
        return content, [(c["name"], c["arguments"]) for c in found]

    assert calls("hermes", 0) == ("Checking.", [("get_weather", '{"city": "a \\" } ] <tool>", "days": 3}'),
                                                ("get_time", "{}"), ("late", '{"b": 1}')])
    assert calls("hermes", 1) == ("after", [("f", '{"a": [1, {"b": null}]}')])
    assert calls("hermes", 2) == ("", [("cut", '{"a": "unfinished')])  # cut short: what was written
    assert calls("qwen3_coder", 0) == ("Let me look.", [
        ("get_weather", '{"city": "New <York>", "days": 3, "hours": [9, 12]}'),
        ("get_weather", '{"city": "Rome", "days": 3, "hours": [9, 12]}')])
    assert calls("qwen3_coder", 1) == ("", [("get_weather", "{}")])
    assert calls("qwen3_coder", 2) == ("<tool_call>\nnot a function\n</tool_call> text", [])
    # cut short: the complete parameters, and what was sent of a string being written
    assert calls("qwen3_coder", 3) == ("", [("get_weather", '{"days": 4, "city": "Os"}')])
    assert calls("qwen3_coder", 4) == ("", [("get_weather", json.dumps({"city": '\nSay "hi" \\ é\n<b>\t</parameter\n'},
                                                                      ensure_ascii=False))])
    assert calls("llama3_json", 0) == ("", [("get_weather", '{"city": "Paris}", "days": 3}'),
                                            ("get_time", '{"tz": "CET"}'), ("late", "{}")])
    assert calls("llama3_json", 1) == ("and then some words", [("f", '{"a": 1}')])
    assert calls("llama3_json", 2) == ("", [("g", '{"a": 1}')])
    assert calls("llama3_json", 3) == ('{"not": "a call"}', [])
    assert calls("llama3_json", 4) == ("A plain answer.", [])
    assert calls("llama3_json", 5) == ("", [("f", '{"a": 1}')])  # a key after the arguments: still one call


@pytest.mark.parametrize("fmt, written, first", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', '{"city": "Par'),
    ("qwen3_coder", XML_CALL[:XML_CALL.index("<parameter=days>") + 20], '{"city": "New <York>"'),
    ("qwen3_coder", XML_CALL[:XML_CALL.index("York")], '{"city": "New '),  # a string streams; "<" may end it
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', '{"city": "Par'),
])
def test_a_calls_arguments_stream_before_it_is_complete(fmt, written, first):
    parser = OutputParser(tools=True, tool_format=TOOL_FORMATS[fmt], schemas=SCHEMAS)
    deltas = parser.feed(written).tool_calls
    assert deltas[0] == CallDelta(0, name="get_weather")
    assert "".join(d.arguments for d in deltas) == first and not any(d.done for d in deltas)


def test_a_long_string_argument_streams_in_bounded_memory():
    """A coding agent writes a whole file as one string parameter (Qwen3-Coder's format): each piece of it is
    scanned and sent once, so the parser holds only what it has not sent (a possible closing tag), not the value so
    far, which it would re-scan on every block (quadratic in the file's length)."""
    body = 'def f(x):\n    return "</function>" + x  # <parameter=y>\n' * 400
    text = (f"<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n{body}\n</parameter>\n"
            "</function>")
    parser = Qwen3CoderParser({"write": {"properties": {"path": {"type": "string"}, "content": {"type": "string"}}}})
    deltas, held = [], 0
    for i in range(0, len(text), 7):
        deltas += parser.feed(text[i:i + 7])
        if parser.open_key == "content":
            held = max(held, len(parser.text))
    assert 0 < held <= 7 + len("\n" + END_PARAMETER)
    assert deltas[-1].done and json.loads("".join(d.arguments or "" for d in deltas)) == {"path": "a.py",
                                                                                           "content": body}


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
def test_several_calls_written_in_one_block_come_out_whole_and_in_order(fmt):
    """Exact mode commits several tokens a forward: one block may end a call, hold a second whole and start a
    third. Each comes out whole, in order, none merged into another (other servers' parsers drop arguments here)."""
    one = {"hermes": '<tool_call>\n{{"name": "{n}", "arguments": {{"i": {i}, "s": "x{i}"}}}}\n</tool_call>\n',
           "qwen3_coder": "<tool_call>\n<function={n}>\n<parameter=i>\n{i}\n</parameter>\n<parameter=s>\nx{i}\n"
                          "</parameter>\n</function>\n</tool_call>\n",
           "llama3_json": '{{"name": "{n}", "parameters": {{"i": {i}, "s": "x{i}"}}}}; '}[fmt]
    text = "".join(one.format(n=f"tool_{i}", i=i) for i in range(3)).rstrip("; \n")
    schemas = {f"tool_{i}": {"properties": {"i": {"type": "integer"}}} for i in range(3)}
    cut = text.index("x0")  # the first block ends inside the first call
    parser = OutputParser(tools=True, tool_format=TOOL_FORMATS[fmt], schemas=schemas)
    first = parser.feed(text[:cut]).tool_calls
    assert first[0] == CallDelta(0, name="tool_0")
    rest = parser.feed(text[cut:]).tool_calls + parser.finish().tool_calls
    _check_call_deltas(first + rest)
    assert [d.index for d in rest] == sorted(d.index for d in rest)  # call 0's end, then 1 whole, then 2 whole
    assert [(c["name"], json.loads(c["arguments"])) for c in whole_calls(first + rest)] == \
        [(f"tool_{i}", {"i": i, "s": f"x{i}"}) for i in range(3)]


def test_without_tools_tool_call_text_is_content():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert _whole(text, False, tools=False) == (text, None, [])
