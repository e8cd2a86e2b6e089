"""The OpenAI HTTP API as pydantic models: what a request may contain, and the error format.

Only the fields that change what Clover does are declared; unknown fields are ignored (as vLLM and SGLang do:
agent frameworks send many optional fields). Declared fields are typed strictly — a string where a number
belongs is a 400, not a silent coercion — and their bounds appear in the OpenAPI schema that the fuzz test reads.
Clover's own options ride along as extra body fields (`block_size`, `threshold`, `rule`; vLLM's `ignore_eos`,
`top_k`, `repetition_penalty`; llama.cpp's DRY `dry_multiplier`, `dry_base`, `dry_allowed_length`,
`dry_penalty_last_n`, `dry_sequence_breakers`, and Clover's `dry_include_prompt`; the loop guard's
`loop_guard_span`, `loop_guard_repeats`; vLLM's `thinking_token_budget`), as in the `extra_body` of the official
client;
`chat_template_kwargs.enable_thinking` switches the `<think>` block on or off (None: the template's default); other
`chat_template_kwargs` are passed to the checkpoint's template. `DecodingFields.to_options(defaults)` translates a
request into the engine's options (the engine checks them).

(Over the 450-line mark: the chat and completion models share their field types, bounds and validators, and one
module shows everything a request may contain; the Responses API's own models are `responses_protocol.py`.)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal, Mapping

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      ValidationError, ValidationInfo, ValidatorFunctionWrapHandler, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from clover.config import check_threshold
from clover.engine.decoding import RULES
from clover.engine.logprobs import MAX_TOP_LOGPROBS
from clover.engine.request import REPETITION_FIELDS, RequestOptions

# -- errors ------------------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error the client caused (4xx) or the server reports, rendered as OpenAI's `{"error": {...}}`.

    `code` is required: every error a client gets has a machine-readable code (OpenAI's, where it has one:
    `invalid_value`, `invalid_type`, `model_not_found`, ...), so clients branch on it rather than on the message."""

    def __init__(self, status: int, message: str, *, code: str, type: str = "invalid_request_error",
                 param: str | None = None) -> None:
        # a message may quote the client's text, lone surrogates included (`"type": "functi\udbffon"`): escaped
        # here, so that rendering the error as UTF-8 JSON cannot itself fail
        message, param = (None if t is None else t.encode("utf-8", "backslashreplace").decode("utf-8")
                          for t in (message, param))
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


# -- shared pieces -----------------------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """A null optional field is its default (`"n": null` is `n=1`), as OpenAI's API takes it."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if v is not None or k not in cls.model_fields or cls.model_fields[k].is_required()}


MAX_NESTING = 64  # JSON values (tool schemas, call arguments): deeper ones would overflow the template's recursion
# Bounds of the per-request options a client sets (a 400 naming the field beyond them): what one request may make
# the server hold or compute, so that no client's values reach a limit of the engine (an int64, a cache) that
# would fail other clients' requests with its own.
MAX_COUNT = 2**31 - 1  # top_k and token budgets (a top_k above the vocabulary keeps every token)
MAX_STOP_CHARS = 1024  # a stop string (the detokenizer holds back this much text)
MAX_BREAKER_CHARS = 256  # a DRY sequence breaker (the engine reads its first 40, as llama.cpp does)
MAX_SCHEMA_CHARS = 64 * 1024  # a response format's JSON schema, as compact JSON (a grammar is compiled from it)


def _well_formed(value: Any) -> Any:
    """`value` (any JSON value) unchanged, or a validation error naming where it holds text that is not Unicode or
    nesting deeper than `MAX_NESTING`.

    JSON's `\\uXXXX` escapes can spell a lone UTF-16 surrogate (`"\\ud800"`), which Python's parser accepts but
    no tokenizer can encode and UTF-8 cannot represent. The parser accepts nesting up to Python's recursion limit,
    which rendering the chat template (`tojson`) then exceeds. Walked iteratively, so the check itself cannot."""
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        where, item, depth = stack.pop()
        if depth > MAX_NESTING:
            raise PydanticCustomError("nesting_too_deep", "nested more than {limit} levels deep",
                                      {"limit": MAX_NESTING})
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise PydanticCustomError(
                    "invalid_unicode", "{where}text is not valid Unicode: a lone UTF-16 surrogate {char} at "
                    "character {index} (surrogate escapes must come in high-low pairs)",
                    {"where": f"{where.lstrip('.')}: " if where else "", "char": ascii(item[exc.start]),
                     "index": exc.start}) from None
        elif isinstance(item, dict):
            for key, sub in item.items():  # a key is checked before its value, so no path holds a bad key
                stack += [(f"{where}.{key:.40}", sub, depth + 1), (f"{where} (a key)", key, depth)]
        elif isinstance(item, list):
            stack += [(f"{where}[{i}]", sub, depth + 1) for i, sub in enumerate(item)]
    return value


# on every field that carries text or JSON (outside a union: one error, not one per member of the union)
WellFormed = BeforeValidator(_well_formed)
Text = Annotated[StrictStr, WellFormed]
UnitFloat = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]  # max_tokens: bounded by the context where it is checked (400)
Count = Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)]
ToolName = Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$"), WellFormed]
StopText = Annotated[StrictStr, Field(max_length=MAX_STOP_CHARS)]
Stop = Annotated[StopText | Annotated[list[Annotated[StopText, Field(min_length=1)]], Field(max_length=16)] | None,
                 WellFormed]
JSONObject = Annotated[dict[str, Any], WellFormed]


def _schema_size(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A response format's schema, at most `MAX_SCHEMA_CHARS` as compact JSON (a validation error otherwise)."""
    if value is not None:
        size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))
        if size > MAX_SCHEMA_CHARS:
            raise PydanticCustomError("schema_too_large", "the schema is {size} characters as compact JSON; at most "
                                      "{limit} are accepted", {"size": size, "limit": MAX_SCHEMA_CHARS})
    return value


Schema = Annotated[dict[str, Any], WellFormed, AfterValidator(_schema_size)]


class StreamOptions(_Model):
    include_usage: StrictBool = False


class DecodingFields(_Model):
    """Fields shared by every generating route (chat, text completions, responses): the model, sampling, and
    Clover's own decoding options."""

    model: Text
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: UnitFloat | None = None
    top_k: Count | None = None  # vLLM extension; 0 = off
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] | None = None
    # keys the noise of sampled tokens (clover.engine.noise), taken mod 2**64
    seed: Annotated[StrictInt, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    # Clover's own options (extra body fields)
    block_size: Annotated[StrictInt, Field(ge=1, le=256)] | None = None
    # the engine's own check (clover.config.check_threshold), run here too so that the 400 names the field
    threshold: Annotated[float, Field(allow_inf_nan=False), AfterValidator(check_threshold)] | None = None
    rule: Literal[tuple(sorted(RULES))] | None = None  # type: ignore[valid-type]  # an unmasking rule's name
    # llama.cpp's DRY (off unless dry_multiplier > 0) and the loop guard (off unless loop_guard_span > 0)
    dry_multiplier: Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)] | None = None
    dry_base: Annotated[float, Field(ge=1.0, le=100.0, allow_inf_nan=False)] | None = None
    dry_allowed_length: Annotated[StrictInt, Field(ge=1, le=1024)] | None = None
    dry_penalty_last_n: Annotated[StrictInt, Field(ge=-1, le=MAX_COUNT)] | None = None
    dry_sequence_breakers: Annotated[list[Annotated[Text, Field(min_length=1, max_length=MAX_BREAKER_CHARS)]],
                                     Field(max_length=32)] | None = None
    dry_include_prompt: StrictBool | None = None
    loop_guard_span: Annotated[StrictInt, Field(ge=0, le=4096)] | None = None
    loop_guard_repeats: Annotated[StrictInt, Field(ge=1, le=1024)] | None = None
    # vLLM's extension: always generate max_tokens (benchmarks); under a grammar, up to where it can only end
    ignore_eos: StrictBool = False
    # vLLM's extension: at most this many reasoning tokens, then the template's closing text is forced
    # (clover.engine.constraints.thinking); absent: reasoning unbounded
    thinking_token_budget: Count | None = None

    def repetition(self) -> dict[str, Any]:
        """The DRY and loop-guard fields the request set, as `RequestOptions.of` keywords."""
        given = {name: getattr(self, name) for name in REPETITION_FIELDS if getattr(self, name) is not None}
        if "dry_sequence_breakers" in given:
            given["dry_sequence_breakers"] = tuple(given["dry_sequence_breakers"])
        return given

    def stop_strings(self) -> tuple[str, ...]:
        return ()

    def logprobs_top(self) -> int | None:
        """Alternatives per token when logprobs are asked for (`RequestOptions.logprobs`), else None."""
        return None

    def to_options(self, defaults: Mapping[str, float], **parts: Any) -> RequestOptions:
        """The request's options as the engine takes them (vLLM's `to_sampling_params(defaults)`): the server's
        `defaults` (temperature, top_p) where the request gives none; `parts`, what the server builds for it
        after routing (a grammar, a thinking budget, its drafting memory). The engine's checks
        (`RequestOptions`, `SamplingParams`) are a 400."""
        if self.thinking_token_budget is not None and self.logprobs_top() is not None:
            raise APIError(400, "thinking_token_budget cannot be combined with logprobs (the closing tokens it "
                                "forces are decided without the model's logits)", param="thinking_token_budget",
                           code="unsupported_parameter")
        given = {name: getattr(self, name) for name in defaults}
        try:
            return RequestOptions.of(
                **{name: defaults[name] if value is None else value for name, value in given.items()},
                top_k=self.top_k or 0, repetition_penalty=self.repetition_penalty or 1.0,
                seed=None if self.seed is None else self.seed % 2**64, stop=self.stop_strings(),
                logprobs=self.logprobs_top(), threshold=self.threshold, ignore_eos=self.ignore_eos,
                **self.repetition(), **parts)
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc


class SamplingFields(DecodingFields):
    """Fields shared by chat and text completions."""

    stop: Stop = None
    n: Annotated[StrictInt, Field(ge=1, le=16)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    # accepted for compatibility, ignored: they have no meaning for this server
    user: Text | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    # OpenAI's token biases (token id -> -100..100): not served, so a non-empty one is refused, not ignored
    logit_bias: Annotated[dict[Annotated[StrictStr, Field(pattern=r"^[0-9]{1,10}$")],
                               Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]],
                          Field(max_length=300)] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise PydanticCustomError("unsupported_parameter", "logit_bias is not supported by this server")
        return value

    def choice_options(self, options: RequestOptions) -> list[RequestOptions]:
        """One `options` per choice (`n`); a seeded request's choice `i` draws with seed `seed + i`."""
        seed = options.sampling.seed
        if seed is None:
            return [options] * self.n
        return [dataclasses.replace(options, sampling=dataclasses.replace(options.sampling, seed=(seed + i) % 2**64))
                for i in range(self.n)]

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            if not self.stop:
                raise APIError(400, "stop strings must be non-empty", param="stop", code="invalid_value")
            return (self.stop,)
        return tuple(self.stop)


# -- chat --------------------------------------------------------------------------------------------------------
class TextPart(_Model):
    type: Literal["text"]
    text: Text


class FunctionCall(_Model):
    name: Text
    arguments: Annotated[StrictStr | dict[str, Any], WellFormed] = "{}"  # OpenAI: a JSON string; an object is accepted

    @field_validator("arguments")
    @classmethod
    def _arguments_nesting(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        """A JSON string is parsed and rendered as an object by the chat template: bound its nesting too."""
        if isinstance(value, str):
            try:
                _well_formed(json.loads(value))
            except json.JSONDecodeError:
                pass  # not JSON: the template renders it verbatim
            except RecursionError:
                raise PydanticCustomError("nesting_too_deep", "nested more than {limit} levels deep",
                                          {"limit": MAX_NESTING}) from None
        return value


class ToolCall(_Model):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[StrictStr | list[TextPart] | None, WellFormed] = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None

    @model_validator(mode="after")
    def _content_present(self) -> "ChatMessage":
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template reads it (`developer` is OpenAI's new name for `system`)."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.content if isinstance(self.content, (str, type(None)))
                               else [p.model_dump() for p in self.content]}
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        return msg


class FunctionDefinition(_Model):
    name: ToolName
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return parameters_schema(value)


def parameters_schema(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tool's `parameters`, checked: OpenAI requires a JSON Schema of an object; the parts the model reads are
    checked here (a ValueError names what is wrong)."""
    if value is None:
        return value
    if value.get("type", "object") != "object":
        raise ValueError(f"parameters must be a JSON Schema with type 'object', got type {value.get('type')!r}")
    props = value.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(p, dict) for p in props.values()):
        raise ValueError("parameters.properties must be an object mapping names to schemas")
    required = value.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError("parameters.required must be a list of property names")
    return value


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: Text


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


# what the server itself gives the chat template (transformers' `apply_chat_template` and its special tokens):
# a request naming one would collide with it (a TypeError) or replace the conversation the server renders
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "template", "chat_template", "tokenizer", "tokenize", "tokenizer_kwargs", "return_dict",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length", "return_tensors", "bos_token",
    "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token", "additional_special_tokens",
    "raise_exception", "strftime_now"})


class ChatTemplateKwargs(_Model):
    """Variables for the chat template: `enable_thinking` (None: the template's own default), and any others the
    checkpoint's template reads, passed through (not those the server sets itself: `RESERVED_TEMPLATE_VARIABLES`)."""

    model_config = ConfigDict(extra="allow")
    enable_thinking: StrictBool | None = None

    @model_validator(mode="after")
    def _not_reserved(self) -> "ChatTemplateKwargs":
        reserved = sorted(set(self.model_extra or {}) & RESERVED_TEMPLATE_VARIABLES)
        if reserved:
            raise ValueError(f"{', '.join(reserved)}: set by the server for the chat template, not by a request")
        return self

    def extra(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


SCHEMA_PARAM = "response_format.json_schema.schema"  # where a request's JSON schema is, as errors name it


class JSONSchemaFormat(_Model):
    """OpenAI structured outputs: `response_format.json_schema` (`schema` is checked by
    `clover.engine.constraints.form`)."""

    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    schema_: Schema = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object with name and schema")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_completion_tokens: PositiveInt | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    parallel_tool_calls: StrictBool | None = None
    # Clover's own: how a json_schema is served ("decision": slot filling, for the form subset; "grammar":
    # constrained decoding; None: decision mode where the schema is a form, else the grammar)
    structured_mode: Literal["decision", "grammar"] | None = None

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _tool_choice_names_a_tool(cls, value: Any, handler: ValidatorFunctionWrapHandler,
                                  info: ValidationInfo) -> Any:
        """Checked as the field (`tools`, declared before it, is in `info.data`), so a 400 names `tool_choice`, not
        the union branch pydantic tried last nor the whole body."""
        try:
            choice = handler(value)
        except ValidationError as exc:
            raise ValueError("give 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
                             ) from exc
        tools = info.data.get("tools") or []
        names = {t.function.name for t in tools}
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not among the tools "
                             f"{sorted(names)}")
        if choice == "required" and not tools:
            raise ValueError("tool_choice 'required' needs tools")
        return choice

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprobs_top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def enable_thinking(self) -> bool | None:
        """The request's `enable_thinking` (None: the template's default)."""
        return self.chat_template_kwargs.enable_thinking if self.chat_template_kwargs else None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- text completions --------------------------------------------------------------------------------------------
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: Annotated[Annotated[StrictStr, Field(min_length=1)]
                      | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=16)]
                      | TokenIds
                      | Annotated[list[TokenIds], Field(min_length=1, max_length=16)], WellFormed]
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # alternatives per token
    suffix: Text | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def max_new_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens

    def logprobs_top(self) -> int | None:
        return self.logprobs  # OpenAI's default for completions
