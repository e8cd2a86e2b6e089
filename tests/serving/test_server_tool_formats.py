"""A checkpoint carrying Qwen3.5's real chat template, served: its tool calls written in the XML format come back as
`tool_calls` with JSON-typed arguments (whole and streamed, free or forced through the grammar), with thinking
on (the template's default) and off (`chat_template_kwargs`)."""

from __future__ import annotations

import json

import pytest

from clover.chat_template import render_chat
from server_helpers import scripted_client, stream_chat, tool_call_entries

NAME = "qwen35"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
OPEN = "<tool_call>\n<function=get_weather>\n"
CALL = OPEN + "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
REASONING = "The user wants a forecast."
USER = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


def script(prompt: str) -> str:
    """What a Qwen3.5-family model writes after this prompt (rendered by its own template)."""
    thinking = prompt.endswith("<think>\n")
    if prompt.endswith(OPEN):  # a forced call of the named function
        return CALL[len(OPEN):]
    if prompt.endswith("<tool_call>\n"):  # tool_choice "required"
        return CALL[len("<tool_call>\n"):]
    if "<tools>" in prompt:
        return (REASONING + "\n</think>\n\n" if thinking else "") + CALL
    return ("Hmm.\n</think>\n\n" if thinking else "") + "Hello."


@pytest.fixture(scope="module")
def tokenizer(qwen35_tokenizer):
    return qwen35_tokenizer


@pytest.fixture(scope="module")
def client(tokenizer):
    with scripted_client(tokenizer, script, NAME, timeout=60) as client:
        yield client


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


EXPECTED = [("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize("thinking", [True, False])
def test_xml_calls_come_back_typed(client, tokenizer, thinking):
    extra = {} if thinking else OFF
    reply = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, max_tokens=96, extra_body=extra)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and _calls(choice.message.tool_calls) == EXPECTED
    assert getattr(choice.message, "reasoning_content", None) == (REASONING if thinking else None)
    # the prompt is the checkpoint's own template's rendering
    prompt = render_chat(tokenizer, USER, TOOLS, add_generation_prompt=True, **({} if thinking else
                                                                                  {"enable_thinking": False}))
    assert reply.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("thinking", [True, False])
def test_streamed_xml_calls(client, thinking):
    content, reasoning, calls, finish, _ = stream_chat(client, model=NAME, messages=USER, tools=TOOLS, max_tokens=96,
                                                       extra_body={} if thinking else OFF)
    assert (content, reasoning, finish) == ("", REASONING if thinking else "", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == EXPECTED


def test_xml_arguments_stream_as_written_and_add_up_to_the_whole_call(client):
    """The call's start, then the string `city` as it is written (`{"city": "` first), `, "days": 3` when its
    closing tag is written, `}` at the end; the official client's stream helper assembles the non-streamed
    response's call."""
    kwargs = dict(model=NAME, messages=USER, tools=TOOLS, max_tokens=96, extra_body={**OFF, "block_size": 1})
    start, *fragments = tool_call_entries(client, **kwargs)
    assert start["function"] == {"name": "get_weather", "arguments": ""} and start["id"].startswith("call_")
    arguments = [e["function"]["arguments"] for e in fragments]
    assert arguments[0].startswith('{"city": "') and arguments[-2:] == [', "days": 3', "}"]
    assert "".join(arguments) == '{"city": "Paris", "days": 3}'
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    with client.chat.completions.stream(**{**kwargs, "tools": strict}) as stream:
        final = stream.get_final_completion()
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert [(c.function.name, c.function.parsed_arguments) for c in final.choices[0].message.tool_calls] == EXPECTED


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_are_written_in_the_models_format(client, choice):
    reply = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice=choice,
                                           max_tokens=96)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert _calls(reply.choices[0].message.tool_calls) == EXPECTED


def test_plain_answers_keep_their_reasoning_apart(client):
    reply = client.chat.completions.create(model=NAME, messages=USER, max_tokens=32)
    assert reply.choices[0].message.content == "Hello."
    assert reply.choices[0].message.reasoning_content == "Hmm."


def test_a_random_hybrid_moe_twin_forced_to_call_writes_a_valid_xml_call(tokenizer):
    """No script: a random Qwen3.5-MoE-shaped twin, its call forced by the grammar in the template's format."""
    from clover.serving import ServerOptions, create_app
    from model_helpers import tiny_model
    from server_helpers import server_thread
    import openai

    model = tiny_model("clover-tiny", vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "detailed": {"type": "boolean"}}, "required": ["city", "detailed"]}}}]
    app = create_app(model, tokenizer, ServerOptions(served_model_name=NAME, prefill_chunk=16))
    with server_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        reply = client.chat.completions.create(model=NAME, messages=USER, tools=tools, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=120)
    assert reply.choices[0].message.tool_calls, reply.choices[0]
    (call,) = reply.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Rome")
    assert isinstance(args["detailed"], bool)


def test_a_conversation_the_template_refuses_is_a_400(client):
    """Qwen3.5's template raises on a conversation without a user turn: the client gets a 400 naming it."""
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=[{"role": "system", "content": "Be brief."}],
                                       max_tokens=8)
    assert "No user query found" in str(err.value) and err.value.body["param"] == "messages"
