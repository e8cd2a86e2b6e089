"""Structured outputs and forced tool calls by grammar-constrained decoding (clover.engine.constraints.grammar): which
requests take this path, and the grammar each one gets.

    tool_choice "required"         one or more calls of the offered tools (exactly one with
                                   `parallel_tool_calls: false`), each call's arguments valid against its tool's
                                   `parameters` (any object when a tool has none)
    tool_choice a named function   one call of that function, its arguments valid against its `parameters`
    response_format json_schema    a schema outside decision mode's form subset, `structured_mode="grammar"`, or
                                   `n > 1` (decision mode answers once): the content is JSON valid against it
    response_format json_object    any JSON object
    either format, with tools and tool_choice "auto" (or absent)
                                   either the call(s) or the JSON answer: the model chooses, the grammar holds
                                   both to their schemas

A forced call ignores `response_format`: the format is for a later turn's text (OpenAI's API behaves so). A call is
the chat template's `<tool_call>` block; the prompt already holds the forced start of the answer (`forced_start`).
Each tool's `strict` only decides what happens to a schema keyword the engine cannot enforce: a strict tool's is a
400 naming it, a non-strict tool's is ignored (the call is still constrained by the rest of its schema). A
response_format schema the engine cannot compile is a 400 naming the keyword.

The request then runs in exact mode (its output is constrained block-size-1 decoding; a request naming another
rule is refused, as block decoding cannot follow a grammar). `tool_choice="auto"` without a response format is not
constrained: the model may answer in text; with `parallel_tool_calls: false` only its first call is returned
(`max_calls`).
"""

from __future__ import annotations

import json
from typing import Any

from clover.engine.constraints.form import FormError, parse_form
from clover.engine.constraints.grammar import Grammar, GrammarError, ToolSchema, json_schema_grammar, tool_call_grammar
from clover.serving.api.protocol import SCHEMA_PARAM, APIError, ChatCompletionRequest, NamedToolChoice
from clover.tool_formats import HERMES, ToolFormat


def offers_tools(req: ChatCompletionRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def forces_call(req: ChatCompletionRequest) -> bool:
    return offers_tools(req) and (req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice))


def max_calls(req: ChatCompletionRequest) -> int | None:
    """How many calls an answer may make (None: any number): one with `parallel_tool_calls: false` or a named
    function."""
    return 1 if req.parallel_tool_calls is False or isinstance(req.tool_choice, NamedToolChoice) else None


def forced_start(req: ChatCompletionRequest, tool_format: ToolFormat = HERMES) -> str:
    """The start of the answer the prompt holds when a call is forced (`tool_format`: the model's call format): the
    call's opening (`<tool_call>\\n`), and for a named function its call up to the arguments; "" otherwise."""
    if not forces_call(req):
        return ""
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function.name
        return tool_format.start + tool_format.head.format(name=name if tool_format.xml else json.dumps(name))
    return tool_format.start


def route(req: ChatCompletionRequest) -> str | None:
    """"decision", "grammar" or None (free text) for a chat request."""
    if forces_call(req):
        return "grammar"  # the call alone, whatever response_format says
    response_format = req.response_format
    if response_format is not None and response_format.type == "json_schema":
        if req.structured_mode == "decision":
            return "decision"  # decision mode refuses what it cannot serve, naming it
        if req.structured_mode is None and not offers_tools(req) and req.n == 1:
            try:
                parse_form(response_format.json_schema.schema_)
                return "decision"
            except FormError:
                pass
        return "grammar"
    if response_format is not None and response_format.type == "json_object":
        return "grammar"
    return None


def grammar_param(req: ChatCompletionRequest) -> str:
    """The field a request's grammar comes from, for an error about it found while decoding: the tools when it may
    call them, else the response format's schema."""
    if offers_tools(req):
        return "tools"
    response_format = req.response_format
    return SCHEMA_PARAM if response_format is not None and response_format.type == "json_schema" else "response_format"


def request_grammar(req: ChatCompletionRequest, tokenizer: Any, tool_format: ToolFormat = HERMES) -> Grammar:
    """The grammar of a request that `route` sends here (the 400 naming the keyword when it cannot compile); calls
    in `tool_format`, the model's format."""
    if req.logprobs:  # refused here, naming the field (the engine refuses it too, later and naming none)
        raise APIError(400, "logprobs cannot be combined with a grammar-constrained answer (tools with tool_choice "
                            "'required' or a function, or a response_format): the tokens a grammar forces are "
                            "decided without the model's logits", param="logprobs", code="unsupported_parameter")
    tools = [ToolSchema(t.function.name, t.function.parameters, bool(t.function.strict))
             for t in req.tools or []] if offers_tools(req) else []
    parallel = max_calls(req) is None
    try:
        if isinstance(req.tool_choice, NamedToolChoice):  # the prompt holds the call up to its arguments
            return tool_call_grammar([t for t in tools if t.name == req.tool_choice.function.name], tokenizer,
                                     tail=tool_format.tail, xml=tool_format.xml)
        if req.tool_choice == "required":  # the prompt holds the call's opening
            return tool_call_grammar(tools, tokenizer, head=tool_format.head, tail=tool_format.tail,
                                     xml=tool_format.xml,
                                     more=tool_format.separator + tool_format.start if parallel else None)
    except GrammarError as exc:
        raise APIError(400, f"tools: {exc}", param="tools", code="unsupported_schema") from exc
    answer = req.response_format
    assert answer is not None and answer.type != "text", "route sends only forced calls and JSON formats here"
    schema = answer.json_schema.schema_ if answer.type == "json_schema" else None
    try:
        grammar = json_schema_grammar(schema, tokenizer)
    except GrammarError as exc:
        param = SCHEMA_PARAM if schema is not None else "response_format"
        raise APIError(400, f"{param}: {exc}", param=param, code="unsupported_schema") from exc
    if not tools:
        return grammar
    try:  # tool_choice "auto": the call(s) or the answer; nothing is forced, so each call's `head` has its start
        return tool_call_grammar(tools, tokenizer, head=tool_format.start + tool_format.head, tail=tool_format.tail,
                                 xml=tool_format.xml,
                                 more=tool_format.separator if parallel else None,
                                 json_answer=schema if schema is not None else {"type": "object"})
    except GrammarError as exc:
        raise APIError(400, f"tools: {exc}", param="tools", code="unsupported_schema") from exc
