"""The Responses API (`/v1/responses`) through the real server stack, driven by the official `openai` client (and
the OpenAI Agents SDK's default model, which speaks it): text, tools and their outputs, forced calls, structured
output, reasoning, streaming events, stored responses. Bodies and events are also parsed strictly with the
`openai` package's own pydantic types, as a typed client would.

Most tests use the scripted model (`server_helpers.ScriptedLM`: it writes what a trained model would, so round
trips are deterministic); one runs a random tiny model against the chat route it translates into."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import get_args

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel

from clover.serving import ServerOptions, create_app
from clover.serving.response_store import ResponseStore
from server_helpers import ScriptedLM, build_checkpoint, server_thread

NAME = "scripted"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather of a city.",
          "parameters": WEATHER_PARAMS}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
REASONING = "The user wants the weather. I should call get_weather."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is 21 degrees in Paris."
JSON_ANSWER = '{"city": "Paris", "temp_c": 21}'
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "temp_c": {"type": "integer"}},
           "required": ["city", "temp_c"], "additionalProperties": False}
ASK = "What is the weather in Paris?"


class Weather(BaseModel):
    city: str
    temp_c: int


def script(prompt: str) -> str:
    """What a trained model writes after this prompt (the rendered chat template)."""
    thinking = prompt.endswith("<think>\n")
    think = (lambda text: text + "\n</think>\n\n") if thinking else (lambda text: "")
    last_turn = prompt[max(prompt.rfind("<|im_start|>user"), 0):]
    if prompt.endswith('"arguments": '):  # a forced call of a named function
        return '{"city": "Paris"}}\n</tool_call>'
    if prompt.endswith("<tool_call>\n"):  # a forced call (tool_choice "required")
        return CALL[len("<tool_call>\n"):]
    if "<tool_response>" in last_turn and "21" in last_turn:
        return think("The tool says 21.") + (JSON_ANSWER if "as JSON" in prompt else ANSWER)
    if "as JSON" in last_turn:
        return JSON_ANSWER
    if "<tools>" in prompt:
        return think(REASONING) + CALL
    if "Fail now." in last_turn:
        raise RuntimeError("the scripted model failed")
    if "What is my name?" in last_turn:
        return "Your name is Ada." if "My name is Ada." in prompt else "I do not know your name."
    return think("A greeting.") + "Hello world."


@pytest.fixture(scope="module")
def app(chat_tokenizer):
    return create_app(ScriptedLM(chat_tokenizer, script), chat_tokenizer,
                      ServerOptions(served_model_name=NAME, prefill_chunk=16))


@pytest.fixture(scope="module")
def url(app):
    with server_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


EVENT_TYPES = {get_args(cls.model_fields["type"].annotation)[0]: cls
               for cls in get_args(get_args(ResponseStreamEvent)[0])}


def raw(url: str, **body) -> dict:
    """A whole response as JSON, checked strictly against the `openai` package's `Response` type."""
    r = httpx.post(f"{url}/v1/responses", json={"model": NAME, **body}, timeout=60)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    return r.json()


def raw_events(url: str, **body) -> list[dict]:
    """A streamed response's events as JSON, each checked strictly against its `openai` type, its SSE `event:` name
    its type, and the sequence numbers 0, 1, 2, ..."""
    events, name = [], None
    with httpx.stream("POST", f"{url}/v1/responses", json={"model": NAME, **body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert event["type"] == name
                EVENT_TYPES[event["type"]].model_validate(event)
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def kinds(events: list[dict]) -> list[str]:
    """Event types, runs of one delta type collapsed to one entry."""
    out: list[str] = []
    for e in events:
        if not (e["type"].endswith(".delta") and out and out[-1] == e["type"]):
            out.append(e["type"])
    return out


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


# -- text ----------------------------------------------------------------------------------------------------------
def test_text_from_a_string_and_from_items_with_usage(client, url):
    r = client.responses.create(model=NAME, input="Hi", max_output_tokens=32)
    assert r.status == "completed" and r.output_text == "Hello world." and r.object == "response"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=32)
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    # instructions, a developer message and text parts render as the chat messages they stand for
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "H"},
                                                              {"type": "input_text", "text": "i"}]}]
    body = raw(url, input=items, instructions="You are Clover.", max_output_tokens=32)
    chat = client.chat.completions.create(model=NAME, max_tokens=32, messages=[
        {"role": "system", "content": "You are Clover."}, {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"}])
    assert body["usage"]["input_tokens"] == chat.usage.prompt_tokens
    assert body["output"][0]["content"][0]["text"] == "Hello world."
    assert body["instructions"] == "You are Clover." and body["store"] is True


def test_the_length_limit_makes_an_incomplete_response(client, url):
    r = client.responses.create(model=NAME, input="Hi", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 2
    events = raw_events(url, input="Hi", max_output_tokens=2)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == r.output_text


# -- tools ---------------------------------------------------------------------------------------------------------
def test_a_tool_call_and_its_output_continue_the_conversation(client):
    first = client.responses.create(model=NAME, input=ASK, tools=TOOLS)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    # the client sends the call back with its output, as the Agents SDK does
    history = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temp_c": 21})}]
    second = client.responses.create(model=NAME, input=history, tools=TOOLS)
    assert second.output_text == ANSWER and second.status == "completed"
    # the same conversation through chat: the same prompt, the same answer
    chat = client.chat.completions.create(model=NAME, tools=CHAT_TOOLS, messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": json.dumps({"temp_c": 21})}])
    assert chat.choices[0].message.content == ANSWER
    assert second.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_forced_tool_choice_comes_back_as_a_function_call(client, choice):
    r = client.responses.create(model=NAME, input="Hi", tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert r.tool_choice == choice if isinstance(choice, str) else r.tool_choice.name == "get_weather"
    assert r.parallel_tool_calls is False


def test_tool_choice_none_leaves_the_text_as_text(client):
    r = client.responses.create(model=NAME, input=ASK, tools=TOOLS, tool_choice="none")
    assert [item.type for item in r.output] == ["message"] and r.output_text == CALL


def test_reasoning_comes_back_as_a_reasoning_item_and_goes_back_in(client):
    r = client.responses.create(model=NAME, input=ASK, tools=TOOLS, reasoning={"effort": "low"})
    reasoning, call = r.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [c.text for c in reasoning.content] == [REASONING] and call.type == "function_call"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    history = [{"role": "user", "content": ASK}, *[item.model_dump(exclude_none=True) for item in r.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}]
    final = client.responses.create(model=NAME, input=history, tools=TOOLS, reasoning={"effort": "low"})
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "The tool says 21." and final.output_text == ANSWER
    off = client.responses.create(model=NAME, input=ASK, tools=TOOLS, reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["function_call"]


# -- structured output ---------------------------------------------------------------------------------------------
def test_structured_output_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    r = client.responses.create(model=NAME, input="The weather in Paris as JSON, please.", text={"format": fmt})
    assert json.loads(r.output_text) == json.loads(JSON_ANSWER) and r.text.format.name == "weather"
    parsed = client.responses.parse(model=NAME, input="The weather in Paris as JSON, please.", text_format=Weather)
    assert parsed.output_parsed == Weather(city="Paris", temp_c=21)
    obj = client.responses.create(model=NAME, input="The weather as JSON.", text={"format": {"type": "json_object"}})
    assert json.loads(obj.output_text) == json.loads(JSON_ANSWER)
    # tools and a format under "auto": the call, or the formatted answer
    call = client.responses.create(model=NAME, input=ASK, tools=TOOLS, text={"format": fmt})
    assert [item.type for item in call.output] == ["function_call"]


# -- streaming -----------------------------------------------------------------------------------------------------
def test_streamed_text_events_and_the_same_response_as_whole(client, url):
    events = raw_events(url, input="Hi")
    assert kinds(events) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello world."
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    whole = raw(url, input="Hi")
    assert without_ids(final["output"]) == without_ids(whole["output"])
    for usage in (final["usage"], whole["usage"]):  # the prefix cache may serve one and not the other
        usage["input_tokens_details"].pop("cached_tokens")
    assert final["usage"] == whole["usage"]
    ids = {e["item_id"] for e in events if "item_id" in e}
    assert ids == {final["output"][0]["id"]}
    assert client.responses.retrieve(final["id"]).output_text == "Hello world."  # a streamed response is stored


def test_streamed_reasoning_and_call_events(url):
    events = raw_events(url, input=ASK, tools=TOOLS, reasoning={"effort": "high"})
    assert kinds(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert sum(e["type"] == "response.reasoning_text.delta" for e in events) > 1  # it flows as blocks commit
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1]
    assert added[1]["item"]["arguments"] == "" and added[1]["item"]["status"] == "in_progress"
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert json.loads(done["arguments"]) == {"city": "Paris"}
    reasoning, call = events[-1]["response"]["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": REASONING}]
    assert call["type"] == "function_call" and call["id"] == done["item_id"]


def test_a_calls_arguments_stream_as_they_are_written(url):
    """Blocks of one token: the call's item is added at its name, its arguments come in several deltas that add up
    to the done event's arguments and the whole response's."""
    events = raw_events(url, input=ASK, tools=TOOLS, block_size=1)
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert len(deltas) > 1 and "".join(deltas) == done["arguments"]
    assert json.loads(done["arguments"]) == {"city": "Paris"}
    assert raw(url, input=ASK, tools=TOOLS, block_size=1)["output"][0]["arguments"] == done["arguments"]


def test_the_openai_client_streams_and_accumulates(client):
    types = [e.type for e in client.responses.create(model=NAME, input="Hi", stream=True)]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    with client.responses.stream(model=NAME, input="The weather in Paris as JSON, please.",
                                 text_format=Weather) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and final.output_parsed == Weather(city="Paris", temp_c=21)
    with client.responses.stream(model=NAME, input=ASK, tools=TOOLS, tool_choice="required") as stream:
        final = stream.get_final_response()
    assert [(item.type, item.name) for item in final.output] == [("function_call", "get_weather")]


def test_a_failure_after_the_stream_started_is_an_error_event_and_a_failed_response(client, url):
    events = raw_events(url, input="Fail now.")
    error, failed = events[-2:]
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert error["type"] == "error" and error["code"] == "server_error"
    assert re.fullmatch(r"internal server error \(request id req_[0-9a-f]+\)", error["message"])  # nothing else
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": error["message"]}
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model=NAME, input="Fail now.")
    assert client.responses.create(model=NAME, input="Hi").output_text == "Hello world."  # it serves on


def test_a_streaming_client_that_leaves_frees_its_slot(url):
    body = {"model": NAME, "input": "Hi", "stream": True, "max_output_tokens": 3000, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept: dropping a half-read iterator closes the connection
        while next(lines) != "event: response.output_text.delta":
            pass
        assert httpx.get(f"{url}/health").json()["running"] == 1
    deadline = time.monotonic() + 30  # 3000 scripted tokens take over a minute
    while httpx.get(f"{url}/health").json()["running"]:
        assert time.monotonic() < deadline, "the departed client's request still runs"
        time.sleep(0.1)


# -- stored responses ----------------------------------------------------------------------------------------------
def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=NAME, input="My name is Ada.", instructions="Be kind.")
    second = client.responses.create(model=NAME, input="What is my name?", previous_response_id=first.id)
    assert second.output_text == "Your name is Ada." and second.previous_response_id == first.id
    alone = client.responses.create(model=NAME, input="What is my name?")
    assert alone.output_text == "I do not know your name."
    # the same conversation sent whole: the same prompt (the earlier instructions are not carried over)
    whole = client.responses.create(model=NAME, store=False, input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert whole.usage.input_tokens == second.usage.input_tokens and whole.output_text == second.output_text
    # tool calls and their outputs through the stored conversation
    call = client.responses.create(model=NAME, input=ASK, tools=TOOLS)
    answer = client.responses.create(model=NAME, tools=TOOLS, previous_response_id=call.id, input=[
        {"type": "function_call_output", "call_id": call.output[0].call_id, "output": '{"temp_c": 21}'}])
    assert answer.output_text == ANSWER
    # retrieval and deletion
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=NAME, input="What is my name?", previous_response_id=first.id)
    assert err.value.body["code"] == "previous_response_not_found"
    assert err.value.body["param"] == "previous_response_id" and first.id in err.value.body["message"]
    assert whole.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)


def test_stored_responses_are_bounded_least_recently_used_first(app, client):
    store = app.state.server.stored
    ids = [client.responses.create(model=NAME, input="Hi").id]
    entry = store.entries[ids[0]][1]
    saved, store.capacity = store.capacity, 2 * len(entry) + len(entry) // 2  # two entries of this size fit
    try:
        ids += [client.responses.create(model=NAME, input="Hi").id for _ in range(2)]
        assert ids[0] not in store.entries and store.size <= store.capacity
        with pytest.raises(openai.BadRequestError, match=ids[0]):
            client.responses.create(model=NAME, input="Hi", previous_response_id=ids[0])
        client.responses.retrieve(ids[1])  # a use: ids[2] is now the least recently used
        ids.append(client.responses.create(model=NAME, input="Hi").id)
        assert ids[1] in store.entries and ids[2] not in store.entries and ids[3] in store.entries
        store.capacity = 0  # --responses-store-mb 0: requests run, nothing is kept, the answer says so
        kept = len(store)
        r = client.responses.create(model=NAME, input="Hi")
        assert r.store is False and r.output_text == "Hello world." and len(store) == kept
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r.id)
    finally:
        store.capacity = saved


def test_the_store_keeps_whole_entries_within_its_bytes():
    store = ResponseStore(capacity=300)
    assert store.put("a", {"x": "1" * 100}, []) and store.put("b", {"x": "2" * 100}, [])
    assert store.get("a") == ({"x": "1" * 100}, [])  # a use: b is evicted next
    assert store.put("c", {"x": "3" * 100}, [])
    assert list(store.entries) == ["a", "c"] and store.size <= 300
    assert not store.put("d", {"x": "4" * 400}, []) and "d" not in store.entries  # larger than the store
    assert store.delete("a") and not store.delete("a") and store.get("a") is None
    assert store.size == len(store.entries["c"][1])
    nothing = ResponseStore(capacity=0)
    assert not nothing.put("a", {}, []) and len(nothing) == 0


# -- errors --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param, code", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "unsupported_parameter"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "unsupported_parameter"),
    ({"background": True}, "background", "unsupported_parameter"),
    ({"include": ["message.output_text.logprobs"]}, "include", "unsupported_parameter"),
    ({"top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
    ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
    ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.message.content.0", "invalid_value"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input.0", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "invalid_value"),
    ({"input": "\ud800"}, "input.0.message.content.0.input_text.text", "invalid_unicode"),
    ({"max_output_tokens": 100000}, "max_output_tokens", "context_length_exceeded"),
    ({"text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "array", "uniqueItems": True}}}},
     "text.format.schema", "unsupported_schema"),
    ({"input": []}, "input", "invalid_value"),
])
def test_what_is_refused_is_a_400_naming_the_field(url, body, param, code):
    r = httpx.post(f"{url}/v1/responses", content=json.dumps({"model": NAME, "input": "Hi", **body}),  # \u escapes
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    if param is not None and "." not in param:
        assert param in error["message"]


def test_unknown_model_and_unknown_response_are_404s(client, url):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.responses.create(model="nope", input="Hi")
    r = httpx.get(f"{url}/v1/responses/resp_unknown")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    assert httpx.delete(f"{url}/v1/responses/resp_unknown").status_code == 404


# -- the OpenAI Agents SDK, on its default model class (Responses) -------------------------------------------------
def test_an_agents_sdk_agent_with_a_forced_tool_and_an_output_type_runs_to_its_final_output(url):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # its traces would go to OpenAI's servers
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(city)
        return json.dumps({"temp_c": 21})

    model = agents.OpenAIResponsesModel(model=NAME, openai_client=openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60))
    agent = agents.Agent(name="weather", instructions="Answer as JSON.", model=model, tools=[get_weather],
                         output_type=Weather, model_settings=agents.ModelSettings(tool_choice="required"))

    async def run() -> list:
        whole = await agents.Runner.run(agent, ASK, max_turns=4)
        streamed = agents.Runner.run_streamed(agent, ASK, max_turns=4)
        async for _ in streamed.stream_events():
            pass
        return [whole.final_output, streamed.final_output]

    assert asyncio.run(run()) == [Weather(city="Paris", temp_c=21)] * 2
    assert calls == ["Paris", "Paris"]  # the forced call, once per run: tool_choice resets after it


# -- a random tiny model: the Responses route answers what the chat route answers ------------------------------------
def test_a_random_model_answers_as_through_chat(tmp_path, chat_tokenizer):
    checkpoint = build_checkpoint(tmp_path / "tiny", chat_tokenizer, max_position_embeddings=256)
    with server_thread(create_app(checkpoint, options=ServerOptions(served_model_name=NAME,
                                                                    prefill_chunk=16))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        messages = [{"role": "system", "content": "You are Clover."}, {"role": "user", "content": "Hello world."}]
        chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12)
        r = client.responses.create(model=NAME, instructions="You are Clover.", input="Hello world.",
                                    max_output_tokens=12)
        assert r.output_text == chat.choices[0].message.content
        assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
        assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                 chat.usage.completion_tokens)
        events = list(client.responses.create(model=NAME, instructions="You are Clover.", input="Hello world.",
                                              max_output_tokens=12, stream=True))
        assert events[-1].response.output_text == r.output_text
        assert events[-1].type == f"response.{r.status}"
