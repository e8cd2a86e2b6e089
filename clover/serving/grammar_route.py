"""Structured outputs by grammar-constrained decoding (clover.engine.grammar): which requests take this path, and
the grammar each one gets.

    response_format json_schema   a schema outside decision mode's form subset (or `structured_mode="grammar"`):
                                  the content is JSON valid against it
    response_format json_object   any JSON object
    tool_choice "required" / a named function, with `strict: true` tools (the named one; for "required", any)
                                  one call whose arguments are valid against the tool's `parameters` (any object
                                  when a tool has none); the call is the chat template's `<tool_call>` block

The request then runs in exact mode (its output is constrained block-size-1 decoding; a request naming another
rule is refused, as block decoding cannot follow a grammar). A schema the engine cannot compile is a 400 that
names the keyword. `tool_choice="auto"` is not constrained: the model may answer in text.
"""

from __future__ import annotations

from typing import Any

from clover.engine.form import FormError, parse_form
from clover.engine.grammar import Grammar, GrammarError, json_schema_grammar, tool_call_grammar
from clover.assistant_output import END_CALL
from clover.serving.protocol import APIError, ChatCompletionRequest, NamedToolChoice

SCHEMA_PARAM = "response_format.json_schema.schema"
CALL_HEAD = '{{"name": {name}, "arguments": '  # the template's call after `<tool_call>\n` (`{name}`: JSON string)
CALL_TAIL = "}\n" + END_CALL


def route(req: ChatCompletionRequest) -> str | None:
    """"decision", "grammar" or None (free text) for a chat request."""
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema":
        if req.structured_mode == "decision":
            return "decision"  # decision mode refuses what it cannot serve, naming it
        if req.structured_mode is None and not (req.tools and req.tool_choice != "none"):
            try:
                parse_form(fmt.json_schema.schema_)
                return "decision"
            except FormError:
                pass
        return "grammar"
    if fmt is not None and fmt.type == "json_object":
        return "grammar"
    if req.tools and req.tool_choice == "required" and any(t.function.strict for t in req.tools):
        return "grammar"
    if req.tools and isinstance(req.tool_choice, NamedToolChoice) and any(
            t.function.strict for t in req.tools if t.function.name == req.tool_choice.function.name):
        return "grammar"
    return None  # a forced call of a non-strict tool: forced by prefix only (served_model.chat_prompt)


def request_grammar(req: ChatCompletionRequest, tokenizer: Any) -> Grammar:
    """The grammar of a request that `route` sends here (the 400 naming the keyword when it cannot compile)."""
    fmt = req.response_format
    if req.tools and req.tool_choice not in (None, "none", "auto") and fmt is not None and fmt.type != "text":
        raise APIError(400, "a forced tool call and response_format cannot be combined", param="response_format",
                       code="invalid_value")
    try:
        if fmt is not None and fmt.type == "json_schema":
            return json_schema_grammar(fmt.json_schema.schema_, tokenizer)
        if fmt is not None and fmt.type == "json_object":
            return json_schema_grammar(None, tokenizer)
        tools = req.tools or []
        if isinstance(req.tool_choice, NamedToolChoice):  # the prompt already holds the call up to its arguments
            tool = next(t for t in tools if t.function.name == req.tool_choice.function.name)
            return tool_call_grammar([(tool.function.name, tool.function.parameters)], tokenizer, tail=CALL_TAIL)
        return tool_call_grammar([(t.function.name, t.function.parameters) for t in tools], tokenizer,
                                 head=CALL_HEAD, tail=CALL_TAIL)
    except GrammarError as exc:
        param = SCHEMA_PARAM if fmt is not None and fmt.type == "json_schema" else "tools"
        raise APIError(400, f"{param}: {exc}", param=param, code="unsupported_schema") from exc
