"""Structured outputs by grammar-constrained decoding, through the official `openai` client: `parse` with pydantic
models outside decision mode's form subset (unbounded strings and integers, nested models, lists, Optional,
Literal, a recursive model), streamed and not, every answer valid; json_object; strict tool calls; routing and
refusals."""

from __future__ import annotations

import json
import random
from typing import Literal, Optional

import httpx
import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, Field, create_model

from server_helpers import concise_server

NAME = "clover-grammar"
MAX_TOKENS = 400


class Item(BaseModel):
    sku: str
    qty: int


class Node(BaseModel):  # recursive
    value: int
    children: list["Node"] = Field(max_length=2)


FIELD_TYPES = [(str, ...), (int, ...), (bool, ...), (Optional[str], ...), (Literal["a", "b", "c"], ...),
               (list[int], ...), (Item, ...), (list[Item], ...), (Optional[Item], ...), (float, ...)]
WORDS = ["order", "weather", "person", "invoice", "ticket", "recipe", "flight", "book"]


def generated_models(n: int, seed: int = 0) -> list[tuple[type[BaseModel], str]]:
    """`n` pydantic models of 1-4 random fields, each with a prompt."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        fields = {f"f{j}_{rng.choice(WORDS)}": rng.choice(FIELD_TYPES) for j in range(rng.randint(1, 4))}
        out.append((create_model(f"Model{i}", **fields), f"Describe a {rng.choice(WORDS)} as JSON ({i})."))
    return out


@pytest.fixture(scope="module")
def client(chat_tokenizer):
    with concise_server(chat_tokenizer, NAME) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("count", [12, pytest.param(40, marks=pytest.mark.slow)])
def test_parse_answers_validate_on_generated_models(client, count):
    finished = 0
    for i, (model, prompt) in enumerate(generated_models(count)):
        out = client.chat.completions.parse(model=NAME, messages=_user(prompt), response_format=model,
                                            max_tokens=MAX_TOKENS, seed=i, temperature=0.0)
        choice = out.choices[0]
        assert choice.finish_reason == "stop", (model.model_json_schema(), choice.message.content)
        assert isinstance(choice.message.parsed, model)
        finished += 1
    assert finished == count


def test_streamed_answers_validate(client):
    for i, (model, prompt) in enumerate(generated_models(6, seed=1)):
        with client.chat.completions.stream(model=NAME, messages=_user(prompt), response_format=model,
                                            max_tokens=MAX_TOKENS) as stream:
            final = stream.get_final_completion()
        assert isinstance(final.choices[0].message.parsed, model)


def test_nested_recursive_and_decision_routing(client):
    out = client.chat.completions.parse(model=NAME, messages=_user("A tree."), response_format=Node,
                                        max_tokens=MAX_TOKENS)
    assert isinstance(out.choices[0].message.parsed, Node)
    assert out.model_extra.get("decision") is None  # the grammar path

    class Form(BaseModel):
        kind: Literal["a", "b"]
        ok: bool

    form = client.chat.completions.parse(model=NAME, messages=_user("Pick."), response_format=Form)
    assert form.model_extra["decision"]  # the form subset still goes to decision mode
    asked = client.chat.completions.parse(model=NAME, messages=_user("Pick."), response_format=Form,
                                          extra_body={"structured_mode": "grammar"})
    assert asked.model_extra.get("decision") is None and isinstance(asked.choices[0].message.parsed, Form)


def test_json_object_answers_are_objects_and_a_cut_one_is_the_beginning_of_a_longer_one(client):
    """`json_object`: every answer that ends is an object (sampled answers, some of which end: which ones varies
    with the drafts exact mode chooses from the machine's cost table); one that max_tokens cuts says so (`length`)
    and is the beginning of the answer the same greedy request gives with more room (the same tokens, the grammar
    enforced up to the cut)."""
    def ask(max_tokens: int, **sampling):
        return client.chat.completions.create(model=NAME, messages=_user("Any JSON object."), max_tokens=max_tokens,
                                              response_format={"type": "json_object"}, **sampling).choices[0]

    ended = [out for seed in range(6) if (out := ask(100, temperature=1.0, seed=seed)).finish_reason == "stop"]
    assert ended
    for out in ended:
        assert isinstance(json.loads(out.message.content), dict), out.message.content
    longer, cut = ask(40, temperature=0.0), ask(4, temperature=0.0)  # greedy nests objects past any budget
    assert cut.finish_reason == longer.finish_reason == "length"
    assert cut.message.content.startswith("{") and longer.message.content.startswith(cut.message.content)
    assert len(longer.message.content) > len(cut.message.content)


def test_too_few_tokens_finish_with_length(client):
    out = client.chat.completions.create(model=NAME, messages=_user("x"), max_tokens=3,
                                         response_format={"type": "json_schema", "json_schema": {
                                             "name": "p", "schema": Item.model_json_schema()}})
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model=NAME, messages=_user("x"), response_format=Item, max_tokens=3)


def test_ignore_eos_with_a_grammar_ends_where_the_grammar_ends(client):
    """ignore_eos keeps the model from ending where the grammar could go on; a complete answer still ends (with the
    model's EOS), the same answer as without ignore_eos for an object, whose end is the grammar's only end."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {
        "type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}, "required": ["ok", "tags"],
        "additionalProperties": False}  # bounded (a random model ends it) and outside the form subset
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    outs = [client.chat.completions.create(model=NAME, messages=_user("An item."), max_tokens=MAX_TOKENS,
                                           response_format=fmt, extra_body={"ignore_eos": ignore})
            for ignore in (True, False)]
    assert [o.choices[0].finish_reason for o in outs] == ["stop", "stop"]
    assert outs[0].choices[0].message.content == outs[1].choices[0].message.content
    jsonschema_rs.validate(schema, json.loads(outs[0].choices[0].message.content))
    assert outs[0].usage.completion_tokens == outs[1].usage.completion_tokens < MAX_TOKENS


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                         "days": {"type": "integer"}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "book", "strict": True, "parameters": {
        "type": "object", "properties": {"items": {"type": "array", "items": Item.model_json_schema()}},
        "required": ["items"], "additionalProperties": False}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book"}}])
def test_strict_tool_calls_validate(client, choice):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for i in range(4):
        out = client.chat.completions.create(model=NAME, messages=_user(f"Call a tool ({i})."), tools=TOOLS,
                                             tool_choice=choice, parallel_tool_calls=False, max_tokens=MAX_TOKENS,
                                             seed=i)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        if isinstance(choice, dict):
            assert calls[0].function.name == "book"
        jsonschema_rs.validate(schemas[calls[0].function.name], json.loads(calls[0].function.arguments))


def test_refusals_name_what_is_wrong(client):
    with pytest.raises(openai.BadRequestError, match="uniqueItems") as err:
        client.chat.completions.create(model=NAME, messages=_user("x"), response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}}})
    assert err.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError, match="cannot follow a grammar"):
        client.chat.completions.parse(model=NAME, messages=_user("x"), response_format=Item,
                                      extra_body={"rule": "threshold"})


LOOSE_TOOLS = [{"type": "function", "function": {  # no `strict`: how LangChain and instructor offer tools
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "tag", "parameters": {  # uniqueItems: not enforced, not refused
        "type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2,
                                                  "uniqueItems": True}},
        "required": ["tags"], "additionalProperties": False}}}]
LOOSE = {t["function"]["name"]: t["function"]["parameters"] for t in LOOSE_TOOLS}


def _valid_calls(choice) -> list[str]:
    """The names of a choice's calls, each call's arguments checked against its tool's schema (`uniqueItems`, which
    a non-strict tool may break, aside)."""
    names = []
    for call in choice.message.tool_calls or []:
        schema = json.loads(json.dumps(LOOSE[call.function.name]).replace('"uniqueItems": true',
                                                                          '"uniqueItems": false'))
        jsonschema_rs.validate(schema, json.loads(call.function.arguments))
        names.append(call.function.name)
    return names


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "tag"}}])
def test_forced_calls_of_tools_that_are_not_strict_are_constrained(client, choice):
    for i in range(3):
        out = client.chat.completions.create(model=NAME, messages=_user(f"Call a tool ({i})."), tools=LOOSE_TOOLS,
                                             tool_choice=choice, parallel_tool_calls=False, max_tokens=MAX_TOKENS,
                                             seed=i, temperature=1.0)
        names = _valid_calls(out.choices[0])
        assert out.choices[0].finish_reason == "tool_calls" and len(names) == 1, out.choices[0]
        assert out.choices[0].message.content is None
        if isinstance(choice, dict):
            assert names == ["tag"]


def test_required_allows_several_calls(client):
    """`parallel_tool_calls` absent: a call may be followed by more. With EOS not allowed (`ignore_eos`), the only
    way on after a finished call is the next call, so the answer holds several, each valid (`parallel_tool_calls:
    false`, one call: the tests above)."""
    for i in range(2):
        out = client.chat.completions.create(model=NAME, messages=_user(f"Call tools ({i})."), tools=LOOSE_TOOLS,
                                             tool_choice="required", max_tokens=MAX_TOKENS, seed=i, temperature=1.0,
                                             extra_body={"ignore_eos": True})
        choice = out.choices[0]
        try:  # the length limit may cut the last call: it ends with the arguments written so far
            json.loads(choice.message.tool_calls[-1].function.arguments)
        except json.JSONDecodeError:
            choice.message.tool_calls.pop()
        assert len(_valid_calls(choice)) >= 2 and choice.finish_reason == "length"


def test_a_strict_tool_the_engine_cannot_enforce_is_refused(client):
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in LOOSE_TOOLS]
    with pytest.raises(openai.BadRequestError, match="uniqueItems") as err:
        client.chat.completions.create(model=NAME, messages=_user("x"), tools=strict, tool_choice="required")
    assert err.value.body["param"] == "tools"


def test_a_forced_call_ignores_the_response_format(client):
    out = client.chat.completions.create(model=NAME, messages=_user("Call."), tools=LOOSE_TOOLS,
                                         tool_choice="required", response_format={"type": "json_object"},
                                         parallel_tool_calls=False, max_tokens=MAX_TOKENS)
    assert out.choices[0].finish_reason == "tool_calls" and _valid_calls(out.choices[0])


def test_auto_with_tools_and_a_response_format_answers_a_call_or_the_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for i in range(4):
        out = client.chat.completions.create(model=NAME, messages=_user(f"Answer or call ({i})."), tools=LOOSE_TOOLS,
                                             response_format=fmt, max_tokens=MAX_TOKENS, seed=i, temperature=1.0)
        choice = out.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and _valid_calls(choice) and choice.message.content is None
        else:
            assert choice.finish_reason == "stop"
            jsonschema_rs.validate(schema, json.loads(choice.message.content))


@pytest.mark.parametrize("schema", [Item.model_json_schema(), {  # outside and inside decision mode's form subset
    "type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "ok": {"type": "boolean"}},
    "required": ["kind", "ok"], "additionalProperties": False}])
def test_n_choices_with_structured_output(client, schema):
    out = client.chat.completions.create(model=NAME, messages=_user("JSON."), n=2, max_tokens=MAX_TOKENS,
                                         temperature=1.0, seed=3, response_format={
                                             "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema_rs.validate(schema, json.loads(choice.message.content))


def test_null_optional_fields_mean_their_defaults(client):
    """OpenAI's API takes null for an optional field; the answer is the one the field's default gives."""
    base = str(client.base_url).rstrip("/")

    def post(route: str, **body) -> dict:
        r = httpx.post(f"{base}/{route}", timeout=60, json={"model": NAME, "max_tokens": 6, "temperature": 0.0, **body})
        assert r.status_code == 200, r.text
        return r.json()

    nulls = {"n": None, "stream": None, "stream_options": {"include_usage": None}, "tools": None, "tool_choice": None,
             "parallel_tool_calls": None, "ignore_eos": None, "chat_template_kwargs": {"enable_thinking": None}}
    chat = post("chat/completions", messages=_user("Hi"), **nulls)
    assert chat["choices"] == post("chat/completions", messages=_user("Hi"))["choices"]
    text = post("completions", prompt="Hi there", n=None, stream=None, echo=None)
    assert text["choices"] == post("completions", prompt="Hi there", echo=False)["choices"]
    assert len(text["choices"]) == 1
