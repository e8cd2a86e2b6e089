"""OpenAI's Responses API request (`POST /v1/responses`) as a pydantic model, and its translation into the chat
request the server already serves (`to_chat`): the Responses API is a second face of the chat path, not a second
engine.

    input (string or items)      -> chat messages: `message` items by role, consecutive `reasoning` / assistant
                                    `message` / `function_call` items -> one assistant message (reasoning_content,
                                    content, tool_calls), `function_call_output` -> a `tool` message
    instructions                 -> a system message first (not carried over by `previous_response_id`, as OpenAI)
    tools (flat function tools)  -> chat tools;  tool_choice, parallel_tool_calls -> the same chat fields
    text.format                  -> response_format (json_schema / json_object), served by the grammar
    max_output_tokens            -> max_completion_tokens
    reasoning.effort             -> the `<think>` block: on for low / medium / high (and above), off for none /
                                    minimal, the chat template's default when absent;
                                    `chat_template_kwargs.enable_thinking` decides when given (its other
                                    variables go to the template)

Validation follows `protocol.py`'s rules (strict types, a null optional field is its default, unknown fields
ignored) and names the Responses field at fault. What the server cannot do is refused with a 400 whose code is
`unsupported_parameter`, naming the field: built-in tools (web_search, file_search, mcp, ...), other tool
choices, `background: true`, `conversation`, `prompt` templates, `truncation: "auto"`, `context_management`,
logprobs (`top_logprobs`, `include: ["message.output_text.logprobs"]`) and every other `include` entry but
`reasoning.encrypted_content` (accepted: reasoning comes back as plain text in the reasoning item's `content`,
which a client sends back the same way). `max_tool_calls` bounds built-in tool calls, of which there are none here:
ignored, as other unknown fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (BeforeValidator, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag, ValidationError,
                      ValidationInfo, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from clover.serving.api.protocol import (APIError, ChatCompletionRequest, ChatTemplateKwargs, DecodingFields,
                                     FunctionCall, JSONObject, PositiveInt, Schema, Text, ToolName, WellFormed, _Model,
                                     parameters_schema)

SUPPORTED_INCLUDES = ("reasoning.encrypted_content",)
THINKING_EFFORTS_OFF = ("none", "minimal")


def _unsupported(message: str, **context: Any) -> PydanticCustomError:
    """A validation error answered as a 400 with code `unsupported_parameter` (middleware.validation_error)."""
    return PydanticCustomError("unsupported_parameter", message, context)


# -- input items -------------------------------------------------------------------------------------------------
class InputText(_Model):
    type: Literal["input_text"]
    text: Text


class OutputText(_Model):
    type: Literal["output_text"]
    text: Text


class Refusal(_Model):
    type: Literal["refusal"]
    refusal: Text


def _as_parts(value: Any) -> Any:
    """String content is one text part (validated as a list: a union's first error would be the string's)."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]
Content = Annotated[list[ContentPart], BeforeValidator(_as_parts)]  # or a string


def _text(content: list[InputText | OutputText | Refusal]) -> str:
    """Message or tool-output content as text: parts joined (as the chat template joins text parts)."""
    return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in content)


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content


class FunctionCallItem(FunctionCall):  # name, arguments (a JSON string), as a chat tool call's function
    type: Literal["function_call"]
    call_id: Text


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: Text
    output: Content


class SummaryText(_Model):
    type: Literal["summary_text"]
    text: Text


class ReasoningText(_Model):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(_Model):
    type: Literal["reasoning"]
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        """The reasoning as the model wrote it (`content`, what this server returns), else its summaries."""
        if self.content:
            return "".join(c.text for c in self.content)
        return "\n\n".join(s.text for s in self.summary)


def _item_type(value: Any) -> str | None:
    """An input item's kind: its `type`, `message` when absent (OpenAI's short form `{"role", "content"}`)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_type)]
AnyItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


# -- tools, formats, options -------------------------------------------------------------------------------------
class ResponsesTool(_Model):
    """A tool, in the Responses API's flat shape (`{"type": "function", "name", "parameters", "strict"}`)."""

    type: Text
    name: ToolName | None = None
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: StrictBool | None = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, value: str) -> str:
        if value != "function":
            raise _unsupported("tool type '{type}' is not supported: this server offers 'function' tools only (the "
                               "model writes the call, the client runs it)", type=value)
        return value

    @field_validator("parameters")
    @classmethod
    def _json_schema_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return parameters_schema(value)

    @model_validator(mode="after")
    def _named(self) -> "ResponsesTool":
        if self.name is None:
            raise ValueError("a function tool needs a name")
        return self

    def function(self) -> dict[str, Any]:
        """The chat API's `function` object."""
        return self.model_dump(include={"name", "description", "parameters", "strict"}, exclude_none=True)


class ResponsesToolChoice(_Model):
    type: Literal["function"]
    name: Text


class TextFormat(_Model):
    """`text.format`: plain text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")] | None = None
    description: StrictStr | None = None
    schema_: Schema | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("type 'json_schema' needs a name and a schema")
        return self

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextOptions(_Model):
    format: TextFormat | None = None  # `verbosity` (a hint to OpenAI's models) is ignored


class ReasoningOptions(_Model):
    effort: Text | None = None
    summary: Text | None = None  # accepted; this server returns the reasoning itself, not a summary


# -- the request -------------------------------------------------------------------------------------------------
class ResponsesRequest(DecodingFields):
    input: list[InputItem]  # a string is one user message
    instructions: Text | None = None
    max_output_tokens: PositiveInt | None = None
    tools: list[ResponsesTool] = []
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    previous_response_id: Text | None = None
    store: StrictBool = True
    stream: StrictBool = False
    metadata: Annotated[dict[str, StrictStr], WellFormed] | None = None  # echoed
    include: list[StrictStr] | None = None
    # refused when set (see the module docstring)
    background: StrictBool = False
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    # Clover's own (extra body field), as in chat
    chat_template_kwargs: ChatTemplateKwargs | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _string_input(cls, value: Any) -> Any:
        return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, value: Any) -> Any:
        """A choice object other than a function's is refused here, naming its type (before the union's
        validation, whose first error would be about the string choices)."""
        if isinstance(value, dict) and value.get("type") != "function":
            raise _unsupported("tool_choice type '{type}' is not supported: give 'auto', 'none', 'required' or "
                               "a function's choice (type 'function' and its name)", type=str(value.get("type")))
        if isinstance(value, dict) and not isinstance(value.get("name"), str):
            raise ValueError("a function tool_choice needs the function's name (a string)")
        if value is not None and not isinstance(value, dict) and value not in ("none", "auto", "required"):
            raise ValueError("give 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, value: Any, info: ValidationInfo) -> Any:
        """Checked as the field (`tools`, declared before it, is in `info.data`): a 400 naming `tool_choice`."""
        names = [t.name for t in info.data.get("tools") or []]
        if isinstance(value, ResponsesToolChoice) and value.name not in names:
            raise ValueError(f"tool_choice names function {value.name!r}, which is not among the tools "
                             f"{sorted(names)}")
        if value == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return value

    @field_validator("include")
    @classmethod
    def _includes(cls, value: list[str] | None) -> list[str] | None:
        for entry in value or []:
            if entry not in SUPPORTED_INCLUDES:
                raise _unsupported("include entry '{entry}' is not supported (this server can include "
                                   "{supported})", entry=entry, supported=", ".join(SUPPORTED_INCLUDES))
        return value

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: bool) -> bool:
        if value:
            raise _unsupported("background responses are not supported: the request is answered (or streamed) "
                               "while it runs")
        return value

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise _unsupported("truncation 'auto' is not supported: the server does not drop input items; an "
                               "input beyond the context is a 400 (context_length_exceeded)")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise _unsupported("logprobs are not served by the Responses API here: use /v1/chat/completions "
                               "(logprobs, top_logprobs)")
        return value

    @field_validator("conversation", "prompt", "context_management")
    @classmethod
    def _refused(cls, value: Any, info: Any) -> Any:
        reasons = {"conversation": "the Conversations API is not served; continue with previous_response_id",
                   "prompt": "stored prompt templates are not served; send instructions and input",
                   "context_management": "the server does not compact conversations"}
        raise _unsupported("{field} is not supported: {reason}", field=info.field_name,
                           reason=reasons[info.field_name])

    @property
    def enable_thinking(self) -> bool | None:
        """None: the chat template's default."""
        if self.chat_template_kwargs is not None and self.chat_template_kwargs.enable_thinking is not None:
            return self.chat_template_kwargs.enable_thinking
        effort = self.reasoning.effort if self.reasoning else None
        return None if effort is None else effort not in THINKING_EFFORTS_OFF

    def text_format(self) -> TextFormat | None:
        return self.text.format if self.text else None


# -- translation -------------------------------------------------------------------------------------------------
def input_messages(items: list[AnyItem]) -> list[dict[str, Any]]:
    """The request's input as chat messages (the module docstring's table)."""
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message that consecutive assistant-side items build
    for item in items:
        if isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
            turn = None
            continue
        if isinstance(item, MessageItem) and item.role != "assistant":
            messages.append({"role": item.role, "content": _text(item.content)})
            turn = None
            continue
        # the model's side: its reasoning, then its text, then its calls (the order the chat template renders)
        said = turn is not None and (turn["content"] is not None or "tool_calls" in turn)
        if turn is None or (isinstance(item, ReasoningItem) and (said or "reasoning_content" in turn)) \
                or (isinstance(item, MessageItem) and said):
            turn = {"role": "assistant", "content": None}
            messages.append(turn)
        if isinstance(item, ReasoningItem):
            turn["reasoning_content"] = item.text()
        elif isinstance(item, MessageItem):
            turn["content"] = _text(item.content)
        else:
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function",
                 "function": {"name": item.name, "arguments": item.arguments}})
    for msg in messages:
        if msg["role"] == "assistant" and msg["content"] is None and "tool_calls" not in msg:
            msg["content"] = ""  # reasoning alone
    return messages


def to_chat(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that answers `req`, whose conversation (the previous response's, then this input) is
    `conversation`: one non-streamed choice; a JSON format always on the grammar path."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    if not messages:
        raise APIError(400, "input is empty: give at least one input item (or instructions)", param="input",
                       code="invalid_value")
    body: dict[str, Any] = {name: getattr(req, name) for name in DecodingFields.model_fields}
    body.update(messages=messages, max_completion_tokens=req.max_output_tokens,
                parallel_tool_calls=req.parallel_tool_calls,
                chat_template_kwargs={**(req.chat_template_kwargs.extra() if req.chat_template_kwargs else {}),
                                      "enable_thinking": req.enable_thinking})
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.function()} for t in req.tools]
    if isinstance(req.tool_choice, ResponsesToolChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    else:
        body["tool_choice"] = req.tool_choice
    text_format = req.text_format()
    if text_format is not None and text_format.type != "text":
        body["response_format"] = {"type": text_format.type}
        if text_format.type == "json_schema":
            body["response_format"]["json_schema"] = {
                "name": text_format.name, "schema": text_format.schema_, "description": text_format.description,
                "strict": text_format.strict}
        body["structured_mode"] = "grammar"  # decision mode answers the chat API only (structured.py)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # what only the whole conversation shows (an empty one)
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"the conversation is not a valid chat: {where}: {first.get('msg')}", param="input",
                       code="invalid_value") from None
