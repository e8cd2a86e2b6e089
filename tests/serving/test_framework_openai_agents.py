"""The OpenAI Agents SDK (`openai-agents`) on the server through its Chat Completions model
(`OpenAIChatCompletionsModel`): an agent with a function tool, `tool_choice="required"` and an `output_type`, run
and streamed to its final output.

The SDK sends the forced choice and the output format together on the first turn (the server answers a call of the
tool), runs the tool, then sends the format with `tool_choice` reset to auto (`Agent.reset_tool_choice`): the
answer is then a call or the JSON answer, the model's choice, both held to their schemas by the server's grammar.
A random model may keep calling the tool, so the runs are bounded (`max_turns`) and greedy (repeatable); the
server of this random model answers in JSON on the second turn (asserted), which the SDK parses into the output
type. The run stays on this machine: tracing, which would send traces to OpenAI, is off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                    set_tracing_disabled)
from agents.items import ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI
from pydantic import BaseModel

from server_helpers import concise_server

NAME = "clover-agents"
MAX_TURNS = 4


class Report(BaseModel):
    city: str
    summary: str


CITIES: list[str] = []  # the cities the tool was called with


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    CITIES.append(city)
    return f"Sunny and 21 C in {city}."


@pytest.fixture(scope="module")
def url(chat_tokenizer) -> Iterator[str]:
    set_tracing_disabled(True)
    try:
        with concise_server(chat_tokenizer, NAME) as u:
            yield u
    finally:
        set_tracing_disabled(False)


def _agent(url: str) -> Agent:
    """The agent, with a client made in the running event loop (an async client's connections belong to one)."""
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    return Agent(name="weather", instructions="Answer with the weather report of the city the user names.",
                 model=OpenAIChatCompletionsModel(model=NAME, openai_client=client), tools=[get_weather],
                 model_settings=ModelSettings(tool_choice="required", temperature=0.0, max_tokens=200),
                 output_type=Report)


def _check_run(items: list, final_output: object) -> None:
    """The forced first turn called the tool (its arguments parsed into the function's), its output went back, and
    the final output is the output type."""
    calls = [i for i in items if isinstance(i, ToolCallItem)]
    outputs = [i for i in items if isinstance(i, ToolCallOutputItem)]
    assert calls and len(outputs) == len(calls)
    assert all(i.raw_item.name == "get_weather" for i in calls)
    assert len(CITIES) == len(calls) and all(isinstance(c, str) for c in CITIES)
    assert isinstance(final_output, Report)


def test_an_agent_with_a_forced_tool_and_an_output_type_runs_to_its_final_output(url):
    CITIES.clear()

    async def run():
        return await Runner.run(_agent(url), "What is the weather in Paris?", max_turns=MAX_TURNS)

    result = asyncio.run(run())
    _check_run(result.new_items, result.final_output)
    assert len(result.raw_responses) == 2  # the forced call, then the formatted answer


def test_a_streamed_run_ends_with_its_final_output(url):
    CITIES.clear()

    async def run():
        streamed = Runner.run_streamed(_agent(url), "What is the weather in Paris?", max_turns=MAX_TURNS)
        events = [event async for event in streamed.stream_events()]
        return streamed, events

    streamed, events = asyncio.run(run())
    assert streamed.is_complete
    _check_run(streamed.new_items, streamed.final_output)
    kinds = {getattr(e, "name", e.type) for e in events}
    assert {"tool_called", "tool_output", "raw_response_event"} <= kinds, kinds
