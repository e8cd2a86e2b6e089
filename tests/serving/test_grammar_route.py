"""The grammar of tools beside a response format under `tool_choice: "auto"` (grammar_route.request_grammar): it
takes every call as the model's format writes it, one start per call, for each tool format; the output parser reads
what it takes as calls, none of it as content. And the 400s of the grammar path name the field at fault."""

from __future__ import annotations

import json

import httpx
import pytest

from clover.assistant_output import OutputParser, whole_calls
from clover.serving.grammar_route import request_grammar
from clover.serving.api.protocol import APIError, ChatCompletionRequest
from clover.tool_formats import TOOL_FORMATS
from server_helpers import concise_server, scripted_client

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
USER = [{"role": "user", "content": "Weather and time in Paris?"}]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


def written(fmt: str, calls: list[tuple[str, dict]]) -> str:
    """`calls` as a model of the format writes them (its chat template's form), each with its own start."""
    if fmt == "hermes":
        return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>'
                         for n, a in calls)
    if fmt == "qwen3_coder":
        return "\n".join(f"<tool_call>\n<function={n}>\n"
                         + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items())
                         + "</function>\n</tool_call>" for n, a in calls)
    return "; ".join(f'{{"name": "{n}", "parameters": {json.dumps(a)}}}' for n, a in calls)


def _accepts(grammar, tok, text: str) -> bool:
    """Whether `text` is a whole answer of `grammar` (fed as the tokenizer splits it)."""
    matcher = grammar.matcher(len(tok), [tok.eos_token_id])
    try:
        matcher.consume(tok(text, add_special_tokens=False)["input_ids"])
    except RuntimeError:
        return False
    return matcher.m.is_accepting()


def _parsed(fmt: str, text: str) -> tuple[str, list[tuple[str, dict]]]:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    parser = OutputParser(tools=True, tool_format=TOOL_FORMATS[fmt], schemas=schemas)
    first, last = parser.feed(text), parser.finish()
    calls = whole_calls(first.tool_calls + last.tool_calls)
    return first.content + last.content, [(c["name"], json.loads(c["arguments"])) for c in calls]


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
def test_auto_with_a_response_format_takes_each_call_with_one_start(chat_tokenizer, fmt):
    """Two calls as the model writes them, or the JSON answer: the grammar takes both, and what it takes parses as
    the calls with no content (a start written twice would land in content: openai-agents' `output_type`,
    pydantic-ai's NativeOutput and LangChain's `bind_tools(response_format=)` send this request)."""
    req = ChatCompletionRequest(model="m", messages=USER, tools=TOOLS, response_format=FORMAT)
    grammar = request_grammar(req, chat_tokenizer, TOOL_FORMATS[fmt])
    two = written(fmt, CALLS)
    assert _accepts(grammar, chat_tokenizer, written(fmt, CALLS[:1]))
    assert _accepts(grammar, chat_tokenizer, two), two
    assert _accepts(grammar, chat_tokenizer, written(fmt, CALLS + CALLS[:1]))
    assert _accepts(grammar, chat_tokenizer, '{"ok": true}')
    assert _parsed(fmt, two) == ("", CALLS)
    start = TOOL_FORMATS[fmt].start
    if start:  # a second call's start written twice is not the format's
        doubled = two.replace(start, start + start)
        assert doubled.count(start) == 4 and not _accepts(grammar, chat_tokenizer, doubled)


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
def test_an_answer_that_starts_as_a_call_does_stays_open(chat_tokenizer, fmt):
    """A format whose call is a JSON object (llama3_json): the answer `{"name": ...}` and the call `{"name": "f",
    ...}` share their first bytes, and both stay possible (the grammar engine lexes greedily)."""
    named = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    req = ChatCompletionRequest(model="m", messages=USER, tools=TOOLS, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": named}})
    grammar = request_grammar(req, chat_tokenizer, TOOL_FORMATS[fmt])
    assert _accepts(grammar, chat_tokenizer, '{"name": "get_weather"}')
    assert _accepts(grammar, chat_tokenizer, written(fmt, CALLS))


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
def test_one_call_only_without_parallel_calls(chat_tokenizer, fmt):
    req = ChatCompletionRequest(model="m", messages=USER, tools=TOOLS, response_format=FORMAT,
                                parallel_tool_calls=False)
    grammar = request_grammar(req, chat_tokenizer, TOOL_FORMATS[fmt])
    assert _accepts(grammar, chat_tokenizer, written(fmt, CALLS[:1]))
    assert not _accepts(grammar, chat_tokenizer, written(fmt, CALLS))


def two_calls(prompt: str) -> str:
    """A model that answers with two calls whenever it is offered tools."""
    return written("hermes", CALLS) if "<tools>" in prompt else "Hello."


@pytest.mark.parametrize("stream", [False, True])
def test_the_served_answer_holds_both_calls_and_no_content(chat_tokenizer, stream):
    """Through the server (the grammar constrains a model writing two calls): both calls come back as `tool_calls`,
    nothing as content, finish reason `tool_calls`, whole and streamed."""
    with scripted_client(chat_tokenizer, two_calls, "two") as client:
        body = dict(model="two", messages=USER, tools=TOOLS, response_format=FORMAT, max_tokens=120)
        if stream:
            from server_helpers import stream_chat
            content, _, calls, finish, _ = stream_chat(client, **body)
            got = [(c["name"], json.loads(c["arguments"])) for c in calls]
        else:
            choice = client.chat.completions.create(**body).choices[0]
            content, finish = choice.message.content or "", choice.finish_reason
            got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    assert (content, got, finish) == ("", CALLS, "tool_calls")


def test_logprobs_with_a_grammar_is_a_400_naming_logprobs(chat_tokenizer):
    for body in ({"response_format": {"type": "json_object"}}, {"tools": TOOLS, "tool_choice": "required"}):
        req = ChatCompletionRequest(model="m", messages=USER, logprobs=True, **body)
        with pytest.raises(APIError) as err:
            request_grammar(req, chat_tokenizer)
        assert (err.value.status, err.value.param) == (400, "logprobs"), err.value.message


@pytest.fixture(scope="module")
def url(chat_tokenizer):
    with concise_server(chat_tokenizer, "m") as url:
        yield url


@pytest.mark.parametrize("route, body, param", [
    ("chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ("chat/completions", {"messages": USER, "tools": TOOLS,
                          "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("chat/completions", {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"messages": USER, "logprobs": True, "response_format": {"type": "json_object"}},
     "logprobs"),
    ("chat/completions", {"messages": USER, "logprobs": True, "tools": TOOLS, "tool_choice": "required"},
     "logprobs"),
    ("responses", {"input": "hi", "tool_choice": "sometimes"}, "tool_choice"),
    ("responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": CITY}],
                   "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ("responses", {"input": "hi", "tool_choice": "required"}, "tool_choice"),
])
def test_a_400_names_the_field_at_fault(url, route, body, param):
    r = httpx.post(f"{url}/v1/{route}", json={"model": "m", "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
