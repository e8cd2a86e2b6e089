"""Forms for decision decoding: the JSON Schema subset `clover.engine.loops.decision` fills, parsed and checked.

A form is a flat object of named fields, each with a finite set of allowed values or a bounded free-text span:

    {"type": "object",
     "properties": {
       "category":    {"enum": ["billing", "bug", "outage"]},               # enumeration of strings
       "needs_human": {"type": "boolean"},
       "priority":    {"type": "integer", "minimum": 1, "maximum": 5},     # bounded range, enumerated
       "summary":     {"type": "string", "maxLength": 40}},                # free text: at most 40 tokens
     "required": ["category", "needs_human", "priority", "summary"],
     "additionalProperties": false}

Every field is filled (a decision answers every question), so `required`, when given, may only name declared
properties. `title` / `description` are accepted anywhere and ignored. Anything else — nested objects, arrays,
`anyOf`, `pattern`, a string without `enum` or `maxLength`, an integer range of more than `MAX_CHOICES` values,
an empty or repeated enumeration — is a `FormError` naming the field and the keyword, so a server can answer 400
with the exact place.

Free text: `maxLength` is a limit in characters (JSON Schema's meaning) and is also the slot's token budget,
capped at `MAX_TEXT_TOKENS`: every token decodes to at least one character, so `maxLength` tokens can always
reach `maxLength` characters; the decoded text is cut to `maxLength` characters, keeping the output valid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_CHOICES = 512  # allowed values of one field (an integer range beyond this is not enumerated)
MAX_TEXT_TOKENS = 64  # a free-text slot is a short span; longer text is generation's job
ANNOTATIONS = {"title", "description"}
FIELD_KEYWORDS = {"type", "enum", "minimum", "maximum", "maxLength"} | ANNOTATIONS
FORM_KEYWORDS = {"type", "properties", "required", "additionalProperties", "$schema"} | ANNOTATIONS


class FormError(ValueError):
    """A schema outside the subset; `path` is where (e.g. `properties.urgency`), `keyword` what (may be None)."""

    def __init__(self, message: str, path: str = "", keyword: str | None = None) -> None:
        where = path if not keyword or path.endswith(keyword) else f"{path}.{keyword}".lstrip(".")
        super().__init__(f"{where}: {message}" if where else message)
        self.path, self.keyword = path, keyword


@dataclass(frozen=True)
class Field:
    """One slot of the form. `choices`: the allowed values (None for free text); `max_chars`: text's limit."""

    name: str
    kind: str  # "enum" | "boolean" | "integer" | "text"
    choices: tuple[Any, ...] | None = None
    max_chars: int = 0

    @property
    def is_text(self) -> bool:
        return self.choices is None

    @property
    def max_tokens(self) -> int:
        return min(self.max_chars, MAX_TEXT_TOKENS)


@dataclass(frozen=True)
class Form:
    fields: tuple[Field, ...]
    schema: dict[str, Any]

    def __post_init__(self) -> None:
        if not self.fields:
            raise FormError("the form has no fields", "properties")

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    def validate(self, values: dict[str, Any]) -> None:
        """Check an answer against the form (what the decoders guarantee; used by tests and callers)."""
        if list(values) != self.names:
            raise ValueError(f"fields {list(values)} != form fields {self.names}")
        for f in self.fields:
            v = values[f.name]
            if f.is_text:
                if not isinstance(v, str) or len(v) > f.max_chars:
                    raise ValueError(f"{f.name}: {v!r} is not a string of at most {f.max_chars} characters")
            elif v not in f.choices or type(v) is not type(f.choices[0]):
                raise ValueError(f"{f.name}: {v!r} is not one of the allowed values")


def parse_form(schema: dict[str, Any] | Form) -> Form:
    """The `Form` a JSON Schema describes, or a `FormError` naming the first thing outside the subset."""
    if isinstance(schema, Form):
        return schema
    if not isinstance(schema, dict):
        raise FormError(f"a form is a JSON Schema object, got {type(schema).__name__}")
    _only(schema, FORM_KEYWORDS, "")
    if schema.get("type", "object") != "object":
        raise FormError(f"the form must have type 'object', got {schema.get('type')!r}", "type", "type")
    props = schema.get("properties")
    if not isinstance(props, dict) or not props:
        raise FormError("the form needs a non-empty 'properties' object", "properties", "properties")
    if schema.get("additionalProperties", False) is not False:
        raise FormError("only additionalProperties: false is supported (the form's fields are fixed)",
                        "additionalProperties", "additionalProperties")
    required = schema.get("required", list(props))
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise FormError("'required' must be a list of property names", "required", "required")
    unknown = [r for r in required if r not in props]
    if unknown:
        raise FormError(f"'required' names undeclared properties {unknown}", "required", "required")
    return Form(tuple(_field(name, spec) for name, spec in props.items()), schema)


def _only(spec: dict[str, Any], allowed: set[str], path: str) -> None:
    for key in spec:
        if key not in allowed:
            raise FormError(f"unsupported keyword {key!r} (decision forms support {sorted(allowed - ANNOTATIONS)})",
                            path, key)


def _field(name: str, spec: Any) -> Field:
    path = f"properties.{name}"
    if not isinstance(spec, dict):
        raise FormError("a field's schema must be an object", path)
    _only(spec, FIELD_KEYWORDS, path)
    kind = spec.get("type")
    if "enum" in spec:
        values = spec["enum"]
        if kind not in (None, "string"):
            raise FormError(f"enum fields are strings; got type {kind!r}", path, "type")
        if not isinstance(values, list) or not values:
            raise FormError("enum must be a non-empty list of strings", path, "enum")
        if not all(isinstance(v, str) for v in values):
            raise FormError(f"enum values must be strings, got {values!r}", path, "enum")
        if len(set(values)) != len(values):
            raise FormError(f"enum has repeated values: {values!r}", path, "enum")
        if len(values) > MAX_CHOICES:
            raise FormError(f"enum has {len(values)} values; at most {MAX_CHOICES}", path, "enum")
        _unused(spec, path, "minimum", "maximum", "maxLength")
        return Field(name, "enum", tuple(values))
    if kind == "boolean":
        _unused(spec, path, "minimum", "maximum", "maxLength")
        return Field(name, "boolean", (True, False))
    if kind == "integer":
        lo, hi = spec.get("minimum"), spec.get("maximum")
        if not _is_int(lo) or not _is_int(hi):
            raise FormError("integer fields need integer 'minimum' and 'maximum' (a bounded range)", path,
                            "minimum" if not _is_int(lo) else "maximum")
        if hi < lo:
            raise FormError(f"empty range: minimum {lo} > maximum {hi}", path, "maximum")
        if hi - lo + 1 > MAX_CHOICES:
            raise FormError(f"range [{lo}, {hi}] has {hi - lo + 1} values, too many to enumerate "
                            f"(at most {MAX_CHOICES})", path, "maximum")
        _unused(spec, path, "maxLength")
        return Field(name, "integer", tuple(range(lo, hi + 1)))
    if kind == "string":
        limit = spec.get("maxLength")
        if limit is None:
            raise FormError("free text needs a limit: give 'maxLength' (or an 'enum')", path, "maxLength")
        if not _is_int(limit) or limit < 1:
            raise FormError(f"maxLength must be a positive integer, got {limit!r}", path, "maxLength")
        _unused(spec, path, "minimum", "maximum")
        return Field(name, "text", None, int(limit))
    raise FormError(f"unsupported type {kind!r}: fields are enum (strings), boolean, integer (with minimum and "
                    f"maximum) or string (with maxLength)", path, "type")


def _unused(spec: dict[str, Any], path: str, *keys: str) -> None:
    for key in keys:
        if key in spec:
            raise FormError(f"keyword {key!r} does not apply to this field's type", path, key)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def value_text(value: Any) -> str:
    """A choice as it appears in the JSON answer (`"billing"`, `true`, `3`)."""
    return json.dumps(value)
