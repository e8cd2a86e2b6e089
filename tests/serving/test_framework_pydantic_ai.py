"""Pydantic AI (`pydantic-ai-slim[openai]`) on the server through an OpenAI-compatible provider
(`OpenAIProvider(base_url=...)`): an agent with a structured output type, by tool output (the default: an output
tool, sent with `tool_choice="required"` since text is not an answer) and by `NativeOutput` (`response_format`
beside the tools, under auto), with a function tool, run to completion.

The model writes nonsense; what the server guarantees is asserted: every call it returns is schema-valid, so
Pydantic AI validates each one with no retry (none is allowed), and the output parses into the pydantic model.
Greedy (repeatable). Which tool an answer calls is the model's choice: this random model calls the function tool
at every turn where it may, so an agent with both a function tool and an output tool never stops by itself; that
run is bounded (`UsageLimits`) and what is asserted is that every turn was a valid call that ran.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, NativeOutput, ToolOutput, capture_run_messages
from pydantic_ai.exceptions import UsageLimitExceeded
from pydantic_ai.messages import ModelResponse, RetryPromptPart, ToolCallPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

from server_helpers import concise_server

NAME = "clover-pydantic-ai"
LIMITS = UsageLimits(request_limit=3)
SETTINGS = {"temperature": 0.0, "max_tokens": 200}


class Report(BaseModel):
    city: str
    summary: str


@pytest.fixture(scope="module")
def model(chat_tokenizer) -> Iterator[OpenAIChatModel]:
    with concise_server(chat_tokenizer, NAME) as url:
        yield OpenAIChatModel(NAME, provider=OpenAIProvider(base_url=f"{url}/v1", api_key="none"))


def _agent(model: OpenAIChatModel, output_type, called: list[str]) -> Agent:
    """An agent with a weather tool that records the cities it is called with in `called`."""
    agent = Agent(model, output_type=output_type, instructions="Report the weather of the city the user names.",
                  retries=0)

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(city)
        return f"Sunny and 21 C in {city}."

    return agent


def _no_retries(messages) -> list[ToolCallPart]:
    """The calls of a run, after checking that none needed a retry (an invalid call or output would)."""
    parts = [p for m in messages for p in m.parts]
    assert not [p for p in parts if isinstance(p, RetryPromptPart)]
    return [p for p in parts if isinstance(p, ToolCallPart)]


PROMPT = "What is the weather in Paris?"


@pytest.mark.parametrize("output_type", [Report, ToolOutput(Report)], ids=["default", "ToolOutput"])
def test_tool_output_runs_to_completion(model, output_type):
    agent = Agent(model, output_type=output_type, instructions="Report the weather of the city the user names.",
                  retries=0)
    result = agent.run_sync(PROMPT, usage_limits=LIMITS, model_settings=SETTINGS)
    assert isinstance(result.output, Report)
    calls = _no_retries(result.all_messages())  # one or more (parallel calls are allowed): the first is the output
    assert calls and {c.tool_name for c in calls} == {"final_result"}


def test_a_function_tool_beside_tool_output_makes_valid_calls_that_run(model):
    """Bounded: this model calls `get_weather` at every turn (its choice; a model that reads the tool's answer calls
    the output tool next), so the run ends at the request limit. Each turn's calls are valid and run; a run that
    ends otherwise ends with the output."""
    called: list[str] = []
    agent = _agent(model, Report, called)
    with capture_run_messages() as messages:
        try:
            output = agent.run_sync(PROMPT, usage_limits=LIMITS, model_settings=SETTINGS).output
        except UsageLimitExceeded:
            output = None
    weather_calls = sum(c.tool_name == "get_weather" for c in _no_retries(messages))
    if output is None:
        assert len(called) == weather_calls > 0
    else:  # an output call skips the function calls beside it (Pydantic AI's `end_strategy="early"`)
        assert isinstance(output, Report) and len(called) <= weather_calls


def test_native_output_with_a_function_tool_runs_to_completion(model):
    result = _agent(model, NativeOutput(Report), []).run_sync(PROMPT, usage_limits=LIMITS, model_settings=SETTINGS)
    assert isinstance(result.output, Report)
    _no_retries(result.all_messages())
