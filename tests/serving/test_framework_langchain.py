"""LangChain's OpenAI chat model (`langchain-openai`'s `ChatOpenAI` with a base URL) on the server of a random tiny
model: a plain answer, a stream, `bind_tools(..., tool_choice=...)`, and `with_structured_output` by function
calling and by JSON schema.

The model writes nonsense; what is asserted is what the server guarantees: LangChain gets the answer the official
client gets, a stream that ends with the same text, forced calls that are schema-valid and parse into LangChain's
tool calls (and run the tool), structured answers that parse into the pydantic model. Greedy (repeatable).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from server_helpers import concise_server

NAME = "clover-langchain"
MAX_TOKENS = 200


class Weather(BaseModel):  # outside decision mode's form subset: the grammar path
    """A weather report."""

    city: str
    temperature: int


class Verdict(BaseModel):  # inside it (enum, boolean): decision mode
    """A verdict."""

    kind: Literal["sunny", "rainy"]
    ok: bool


@tool
def get_weather(city: str, unit: Literal["c", "f"]) -> str:
    """The current weather in a city."""
    return f"21 degrees {unit} in {city}"


@tool
def get_time(city: str) -> str:
    """The local time in a city."""
    return f"noon in {city}"


@pytest.fixture(scope="module")
def url(chat_tokenizer) -> Iterator[str]:
    with concise_server(chat_tokenizer, NAME) as u:
        yield u


@pytest.fixture(scope="module")
def llm(url) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{url}/v1", api_key="none", model=NAME, temperature=0.0, max_tokens=MAX_TOKENS,
                      max_retries=0, timeout=120)


PROMPT = "What is the weather in Paris?"


def test_invoke_gets_what_the_official_client_gets(llm, url):
    out = llm.invoke(PROMPT, max_tokens=12)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    expected = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPT}],
                                              temperature=0.0, max_tokens=12).choices[0]
    assert isinstance(out, AIMessage) and out.content == expected.message.content
    assert out.response_metadata["finish_reason"] == expected.finish_reason
    assert out.usage_metadata["output_tokens"] > 0


def test_a_stream_ends_with_the_whole_answer(llm):
    chunks = list(llm.stream(PROMPT, max_tokens=12))
    assert chunks and all(isinstance(c, AIMessageChunk) for c in chunks)
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    assert whole.content == llm.invoke(PROMPT, max_tokens=12).content
    assert whole.response_metadata["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("choice", ["get_weather", "any", "required"])
def test_bind_tools_with_a_forced_choice_makes_one_valid_call_that_runs(llm, choice):
    out = llm.bind_tools([get_weather, get_time], tool_choice=choice, parallel_tool_calls=False).invoke(PROMPT)
    assert len(out.tool_calls) == 1 and not out.invalid_tool_calls, out
    assert out.response_metadata["finish_reason"] == "tool_calls"
    if choice == "get_weather":
        assert out.tool_calls[0]["name"] == "get_weather"
    _run(out.tool_calls)


def test_bind_tools_with_parallel_calls_makes_valid_calls(llm):
    """Parallel calls allowed (LangChain's default): this model writes calls until the token budget; every call it
    finished is valid and runs (a cut one is not returned as a call)."""
    out = llm.bind_tools([get_weather, get_time], tool_choice="any").invoke(PROMPT)
    assert out.tool_calls and not out.invalid_tool_calls, out
    assert out.response_metadata["finish_reason"] in ("tool_calls", "length")
    _run(out.tool_calls)


def _run(calls: list[dict]) -> None:
    """Run each call's tool: LangChain validates the arguments against the tool's signature."""
    tools = {"get_weather": get_weather, "get_time": get_time}
    for call in calls:
        result = tools[call["name"]].invoke(call)
        assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]


@pytest.mark.parametrize("schema", [Weather, Verdict])
@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_with_structured_output_parses_into_the_model(llm, method, schema):
    out = llm.with_structured_output(schema, method=method, include_raw=True).invoke(PROMPT)
    assert out["parsing_error"] is None
    assert isinstance(out["parsed"], schema)


def test_with_structured_output_streams(llm):
    chunks = list(llm.with_structured_output(Weather, method="json_schema").stream(PROMPT))
    assert chunks and isinstance(chunks[-1], Weather)
