"""Tool calls and reasoning through the real server stack (HTTP, scheduler, engine, cache), with a scripted model
that writes what a trained model would, so the round trips are deterministic."""

from __future__ import annotations

import json

import pytest

from server_helpers import scripted_client, stream_chat, tool_call_entries

NAME = "scripted"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
REASONING = "The user wants the weather. I should call get_weather."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is 21 degrees in Paris."
JSON_ANSWER = '{"city": "Paris", "temp_c": 21}'
TWO_CALLS = CALL + "\n" + CALL.replace("Paris", "Rome")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "temp_c": {"type": "integer"}},
           "required": ["city", "temp_c"]}


def script(prompt: str) -> str:
    """What a trained model writes after this prompt (the prompt is the rendered chat template)."""
    thinking = prompt.endswith("<think>\n")
    last_turn = prompt[max(prompt.rfind("<|im_start|>user"), 0):]  # (exact mode calibrates on other text)
    if prompt.endswith('"arguments": '):  # a forced call (tool_choice names the function)
        return '{"city": "Paris"}}\n</tool_call>'
    if prompt.endswith("<tool_call>\n"):  # a forced call (tool_choice "required"): two when asked for two cities
        return (TWO_CALLS if "and Rome" in last_turn else CALL)[len("<tool_call>\n"):]
    if "as JSON" in last_turn:
        return JSON_ANSWER
    if "and Rome" in last_turn:
        return TWO_CALLS
    if "<tool_response>" in last_turn and "21" in last_turn:
        return ("The tool says 21.\n</think>\n\n" if thinking else "") + ANSWER
    if "<tools>" in prompt:
        return (REASONING + "\n</think>\n\n" if thinking else "") + CALL
    return "Hello world."


@pytest.fixture(scope="module")
def client(chat_tokenizer):
    with scripted_client(chat_tokenizer, script, NAME, timeout=60) as client:
        yield client


USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_call_round_trip(client):
    first = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, max_tokens=64)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    history = USER + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}]
    second = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=64)
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"
    assert not second.choices[0].message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_streamed_tool_call(client):
    content, reasoning, calls, finish, _ = stream_chat(client, model=NAME, messages=USER, tools=TOOLS, max_tokens=64)
    assert (content, reasoning, finish) == ("", "", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_")


def test_reasoning_content_streamed_and_whole(client):
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    whole = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, max_tokens=96, extra_body=thinking)
    message = whole.choices[0].message
    assert message.reasoning_content == REASONING and message.tool_calls[0].function.name == "get_weather"
    content, reasoning, calls, finish, order = stream_chat(client, model=NAME, messages=USER, tools=TOOLS, max_tokens=96,
                                                       extra_body=thinking)
    assert reasoning == REASONING and calls[0]["name"] == "get_weather" and finish == "tool_calls"
    assert order.index("tool_call") > max(i for i, kind in enumerate(order) if kind == "reasoning")
    assert order.count("reasoning") > 1  # reasoning flows as it is written, not at the end
    # with the tool result: reasoning, then the answer
    history = USER + [{"role": "assistant", "content": None, "reasoning_content": REASONING, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    final = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=96,
                                           extra_body=thinking)
    assert final.choices[0].message.content == ANSWER
    assert final.choices[0].message.reasoning_content == "The tool says 21."


def test_named_tool_choice_forces_the_call(client):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=64)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_choice_none_leaves_the_text_as_content(client):
    r = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=64)
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_plain_chat_without_tools(client):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=32, n=2)
    assert [c.message.content for c in r.choices] == ["Hello world.", "Hello world."]
    assert stream_chat(client, model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=32)[0] == "Hello world."


def _calls(choice) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]


def test_required_tool_choice_forces_a_call_of_a_tool_that_is_not_strict(client):
    """The call is constrained (grammar path) whatever `strict` says; the model's call comes through unchanged."""
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                                       tool_choice="required", max_tokens=64)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert _calls(r.choices[0]) == [("get_weather", {"city": "Paris"})]


def test_parallel_tool_calls_false_returns_the_first_call_under_auto(client):
    two = [{"role": "user", "content": "What is the weather in Paris and Rome?"}]
    both = client.chat.completions.create(model=NAME, messages=two, tools=TOOLS, max_tokens=96)
    assert _calls(both.choices[0]) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    for stream in (False, True):
        kwargs = dict(messages=two, tools=TOOLS, max_tokens=96, parallel_tool_calls=False)
        if stream:
            _, _, calls, finish, _ = stream_chat(client, model=NAME, **kwargs)
            assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
        else:
            one = client.chat.completions.create(model=NAME, **kwargs)
            assert _calls(one.choices[0]) == [("get_weather", {"city": "Paris"})]
            finish = one.choices[0].finish_reason
        assert finish == "tool_calls"


def test_auto_with_a_response_format_allows_a_call_or_the_formatted_answer(client):
    """tools + response_format under tool_choice "auto": one grammar of both; the model takes either branch."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    call = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, response_format=fmt, max_tokens=64)
    assert call.choices[0].finish_reason == "tool_calls"
    assert _calls(call.choices[0]) == [("get_weather", {"city": "Paris"})]
    asked = [{"role": "user", "content": "The weather in Paris as JSON, please."}]
    text = client.chat.completions.create(model=NAME, messages=asked, tools=TOOLS, response_format=fmt,
                                         max_tokens=64)
    assert text.choices[0].finish_reason == "stop" and not text.choices[0].message.tool_calls
    assert json.loads(text.choices[0].message.content) == json.loads(JSON_ANSWER)


def test_a_forced_call_with_a_response_format_is_the_call(client):
    """OpenAI's API: the format applies to a later text turn; this turn is the call."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                                           tool_choice=choice, response_format=fmt, max_tokens=64)
        assert r.choices[0].finish_reason == "tool_calls"
        assert _calls(r.choices[0]) == [("get_weather", {"city": "Paris"})]


# -- calls streamed as they are written ---------------------------------------------------------------------------
TWO = [{"role": "user", "content": "What is the weather in Paris and Rome?"}]
BOTH = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


def test_a_streamed_calls_first_argument_fragment_comes_before_the_call_is_complete(client):
    """Blocks of two tokens: the call's start (id, type, name, empty arguments) comes first, then its arguments in
    fragments, the first sent while the arguments are still unfinished."""
    entries = tool_call_entries(client, model=NAME, messages=USER, tools=TOOLS, max_tokens=64,
                                extra_body={"block_size": 2})
    start, *fragments = entries
    assert start["index"] == 0 and start["id"].startswith("call_") and start["type"] == "function"
    assert start["function"] == {"name": "get_weather", "arguments": ""}
    assert all(e["index"] == 0 and set(e) == {"index", "function"} for e in fragments)
    arguments = [e["function"]["arguments"] for e in fragments]
    assert len(arguments) > 1 and json.loads("".join(arguments)) == {"city": "Paris"}
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments[0])  # sent before the call was complete


def test_several_calls_committed_by_one_block_stream_whole_and_in_order(client):
    """One block holds the whole answer (both calls arrive in one engine step): each call is sent whole (its start,
    then all its arguments), in order, as the whole response has them."""
    kwargs = dict(model=NAME, messages=TWO, tools=TOOLS, max_tokens=128, extra_body={"block_size": 128})
    entries = tool_call_entries(client, **kwargs)
    assert [(e["index"], "id" in e) for e in entries] == [(0, True), (0, False), (1, True), (1, False)]
    streamed = [(entries[i]["function"]["name"], entries[i + 1]["function"]["arguments"]) for i in (0, 2)]
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert streamed == [(c.function.name, c.function.arguments) for c in whole]
    assert [(n, json.loads(a)) for n, a in streamed] == BOTH


STRICT_TOOLS = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True, "parameters": {
    **TOOLS[0]["function"]["parameters"], "additionalProperties": False}}}]


@pytest.mark.parametrize("decoding", [{"block_size": 1}, {"block_size": 3}, {"block_size": 128}, {"rule": "exact"}])
def test_the_openai_stream_helper_assembles_the_whole_responses_calls(client, decoding):
    """`client.chat.completions.stream` (the official client's accumulator, parsing strict tools' arguments as they
    grow) ends with the calls of the non-streamed response, whatever a step commits (one token, three, the whole
    answer, exact mode's accepted drafts); its argument events add up to each call."""
    kwargs = dict(model=NAME, messages=TWO, tools=STRICT_TOOLS, max_tokens=128, extra_body=decoding)
    with client.chat.completions.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(c.function.name, c.function.parsed_arguments) for c in calls] == BOTH
    assert final.choices[0].finish_reason == whole.finish_reason == "tool_calls"
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    for index, call in enumerate(calls):
        assert "".join(e.arguments_delta for e in deltas if e.index == index) == call.function.arguments
    done = [(e.index, e.name, e.parsed_arguments) for e in events if e.type == "tool_calls.function.arguments.done"]
    assert done == [(i, n, a) for i, (n, a) in enumerate(BOTH)]
    if decoding.get("block_size", 0) < 128:
        assert len(deltas) > len(calls)  # fragments, not whole calls


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_parallel_tool_calls_false_gives_at_most_one_call(client, tool_choice):
    """Two calls asked for: `false` keeps the model's first under auto and lets the grammar write only one when a
    call is forced; streamed and whole alike."""
    kwargs = dict(model=NAME, messages=TWO, tools=TOOLS, tool_choice=tool_choice, max_tokens=128)
    assert _calls(client.chat.completions.create(**kwargs).choices[0]) == BOTH
    one = client.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0]
    assert _calls(one) == BOTH[:1] and one.finish_reason == "tool_calls"
    _, _, calls, finish, _ = stream_chat(client, parallel_tool_calls=False, **kwargs)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == BOTH[:1] and finish == "tool_calls"
    entries = tool_call_entries(client, parallel_tool_calls=False, **kwargs)
    assert {e["index"] for e in entries} == {0}
