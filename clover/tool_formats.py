"""How a model family writes tool calls, chosen from its chat template: the parsers behind `tool_calls`.

    hermes       <tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>
                 Clover's own template, Qwen2.5, Qwen3, Hermes 2 / 3
    qwen3_coder  <tool_call>\\n<function=f>\\n<parameter=x>\\n1\\n</parameter>\\n</function>\\n</tool_call>
                 Qwen3-Coder, Qwen3.5 / 3.6 (the flagship's base), Qwen3-Next
    llama3_json  {"name": "f", "parameters": {"x": 1}}     (the whole answer; `<|python_tag|>` allowed first,
                 several calls separated by `;`) Llama 3.1 / 3.2 / 3.3

`detect` reads the template's own text for the tags it writes (vLLM and SGLang make the user pick a parser per
model; `clover serve --tool-call-parser` still overrides). The XML format carries every value as text: each is
converted to JSON by the type its tool's schema gives that parameter (`integer`, `number`, `boolean`, `object`,
`array`, `null`; a string stays a string; a parameter the schema does not type is read as JSON when it parses).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

CALL, END_CALL = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolFormat:
    """`wrapped`: calls sit in `<tool_call>` blocks among other text; else the whole answer is the call(s).
    How a call is written, as the grammar of a forced call writes it: `start`, then `head` (`{name}`: the tool's
    name, JSON-quoted unless `xml`), the arguments (a JSON object, or `xml` parameter blocks), `tail`; calls
    separated by `separator`."""

    name: str
    start: str
    head: str
    tail: str
    separator: str
    xml: bool = False
    wrapped: bool = True

    def parse(self, body: str, schemas: dict[str, Any] | None = None) -> list[dict[str, str]] | None:
        """The calls (`{"name", "arguments": "<json object>"}`) in `body` (a block's inside, or the whole answer
        when not `wrapped`), or None when it is not well formed. `schemas`: tool name -> its `parameters`."""
        if self.name == "qwen3_coder":
            call = _parse_xml(body, schemas or {})
            return None if call is None else [call]
        if self.name == "llama3_json":
            return _parse_llama3(body)
        call = _parse_json_call(body, "arguments")
        return None if call is None else [call]


HERMES = ToolFormat("hermes", CALL + "\n", '{{"name": {name}, "arguments": ', "}\n" + END_CALL, "\n")
QWEN3_CODER = ToolFormat("qwen3_coder", CALL + "\n", "<function={name}>\n", "</function>\n" + END_CALL, "\n", xml=True)
LLAMA3_JSON = ToolFormat("llama3_json", "", '{{"name": {name}, "parameters": ', "}", "; ", wrapped=False)
FORMATS = {f.name: f for f in (HERMES, QWEN3_CODER, LLAMA3_JSON)}


def detect(template: str | None) -> ToolFormat:
    """The format a chat template writes its calls in (Hermes when it shows none)."""
    if not template:
        return HERMES
    if "<function=" in template and "<parameter=" in template:
        return QWEN3_CODER
    if CALL in template:
        return HERMES
    if PYTHON_TAG in template or ('"parameters"' in template and "ipython" in template):
        return LLAMA3_JSON
    return HERMES


def _canonical(name: Any, args: Any) -> dict[str, str] | None:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not isinstance(args, dict):
        return None
    return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}


def _parse_json_call(body: str, key: str) -> dict[str, str] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _canonical(obj.get("name"), obj.get(key, {})) if isinstance(obj, dict) else None


def _parse_llama3(text: str) -> list[dict[str, str]] | None:
    text = text.strip().removeprefix(PYTHON_TAG).strip()
    if not text.startswith("{"):
        return None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            obj, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        call = _canonical(obj.get("name"), obj.get("parameters", obj.get("arguments", {})))
        if call is None:
            return None
        calls.append(call)
        rest = text[end:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        at = len(text) - len(rest[1:].lstrip())
    return calls or None


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.S)


def _parse_xml(body: str, schemas: dict[str, Any]) -> dict[str, str] | None:
    match = _FUNCTION.fullmatch(body)
    if match is None:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    properties = (schemas.get(name) or {}).get("properties") or {}
    args, at = {}, 0
    for param in _PARAMETER.finditer(inner):
        if inner[at:param.start()].strip():
            return None
        key = param.group(1).strip()
        args[key] = typed_value(param.group(2), properties.get(key))
        at = param.end()
    if inner[at:].strip():
        return None
    return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type calls for (the text itself when it does not fit)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if kinds == ["string"]:
        return text
    stripped = text.strip()
    for kind in kinds:
        if kind == "integer" and re.fullmatch(r"-?\d+", stripped):
            return int(stripped)
        if kind == "number":
            try:
                number = float(stripped)
            except ValueError:
                continue
            return int(number) if number.is_integer() and re.fullmatch(r"-?\d+", stripped) else number
        if kind == "boolean" and stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        if kind == "null" and stripped.lower() in ("null", "none"):
            return None
        if kind in ("object", "array"):
            try:
                value = json.loads(stripped)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict if kind == "object" else list):
                return value
    if "string" in kinds:
        return text
    if not kinds:  # untyped: JSON when it parses as such
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            return text
    return text
