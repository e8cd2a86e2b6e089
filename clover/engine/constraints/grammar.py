"""Grammars that constrain decoding: a JSON Schema (or any JSON object, or a tool call) compiled for a tokenizer,
and the per-request matcher the decoding loop asks which tokens may come next.

The engine is llguidance (chosen by measurement: docs/structured.md): one wheel with no dependencies, fast to
compile a schema and to compute a mask, and a refusal that names the keyword it
cannot enforce (`uniqueItems`, `if`/`then`) instead of silently ignoring it.

    grammar = json_schema_grammar(schema, tokenizer)       # GrammarError (a ValueError) naming the keyword
    generate(model, prompts, grammar=grammar, rule="exact")

What a grammar changes in decoding (clover.engine.loops.exact): the causal choice is made among the allowed tokens
only, and the tokens the grammar forces (llguidance's fast-forward tokens: the canonical tokenization of bytes no
choice can change, e.g. `", "` and the next key) are committed with no forward of their own; when the grammar can
only end, an EOS is forced too. This is part of the definition of constrained decoding, the same at every block
size, so exact mode's output stays constrained block-size-1 greedy decoding, token for token.

With `ignore_eos` (an engine with no EOS ids) a grammar still ends its answer: the model's EOS (`end_ids`) is
allowed only where the grammar can only end, so the answer never stops where the grammar could go on (a
top-level number may take more digits) and ends, with that EOS, where it is complete.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch


# JSON without optional whitespace, separated as json.dumps does: whitespace the grammar allows anywhere is what a
# model can repeat forever (a small or uncertain model does), and one layout gives the grammar tokens to force
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[([^\]]*)\]')


class GrammarError(ValueError):
    """A schema the grammar engine cannot compile; `keyword`: the JSON Schema keyword at fault, when known."""

    def __init__(self, message: str, keyword: str | None = None) -> None:
        super().__init__(message)
        self.keyword = keyword


class GrammarTooComplex(GrammarError):
    """A grammar that compiled but that the engine gave up following while decoding: one of its limits (parse items
    at one position, lexer states) was reached. The schema's doing (e.g. hundreds of `anyOf` branches open at
    once), so the request's, not a defect of the decoder."""


@functools.cache
def _llguidance() -> Any:
    """The grammar engine, imported on first use: `llguidance.torch` imports `torch._dynamo` (seconds), which a
    command that constrains nothing should not pay."""
    try:
        # deferred: llguidance.torch imports torch._dynamo (seconds), for constrained requests only
        import llguidance
        import llguidance.torch
    except ImportError as exc:  # a dependency; the error says what to install
        raise ImportError("grammar-constrained decoding needs llguidance: pip install llguidance") from exc
    return llguidance


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of a fast tokenizer (`clover.tokenizer.Tokenizer` or `transformers`'; ~1-2 s to build on a
    49k vocabulary: built once): its Rust tokenizer serialised without padding or truncation."""
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return _llguidance().LLTokenizer(backend.to_str(), eos_token=tokenizer.eos_token_id)


@dataclass(frozen=True, eq=False)
class Grammar:
    """A grammar compiled (validated) for one tokenizer; `matcher()` gives a request its own state."""

    source: str  # llguidance's grammar (JSON of a TopLevelGrammar)
    tokenizer: Any  # llguidance's tokenizer
    description: str  # what it accepts, for errors and logs

    def matcher(self, vocab_size: int, eos_ids: Sequence[int], end_ids: Sequence[int] = ()) -> Matcher:
        return Matcher(self, vocab_size, eos_ids, end_ids)


def _compile(source: str, tokenizer: Any, description: str) -> Grammar:
    ll_tok = _ll_tokenizer(tokenizer)
    failed, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(source, ll_tok)
    if failed:
        message = messages[0] if messages else "invalid grammar"
        found = _UNIMPLEMENTED.search(message)
        keyword = json.loads(f"[{found.group(1)}]")[0] if found else None
        raise GrammarError(f"{description}: {message}" + (f" (the keyword {keyword!r} is not supported)"
                                                          if keyword else ""), keyword)
    return Grammar(source, ll_tok, description)


_OTHER_PROPERTIES = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SUBSCHEMAS = ("items", "additionalItems", "contains")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")


def closed_objects(schema: Any) -> Any:
    """`schema` with every object that lists its `properties` and says nothing of others (no
    `additionalProperties`, `patternProperties`, `unevaluatedProperties`) closed to those: xgrammar's strict mode,
    the default of vLLM and SGLang. A tool's parameters are a function's signature and a response format is the
    shape a client parses: a key they do not declare is never wanted, and a model allowed any key can nest
    undeclared objects past any budget. Objects that list no properties stay open; `allOf` branches (closing each
    would reject the intersection) and `not` are left as they are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    listed = out.get("properties")
    required = out.get("required") if isinstance(out.get("required"), list) else []
    if (isinstance(listed, dict) and not any(k in out for k in _OTHER_PROPERTIES)
            and all(k in listed for k in required)):  # a required key it does not list is one of the others
        out["additionalProperties"] = False
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_objects(out["additionalProperties"])
    return out


def json_schema_grammar(schema: dict[str, Any] | None, tokenizer: Any) -> Grammar:
    """A JSON value valid against `schema` (None: any JSON object, OpenAI's `json_object`), its objects holding only
    the properties they list (`closed_objects`). Raises `GrammarError` naming the keyword the engine cannot
    enforce."""
    if schema is not None and not isinstance(schema, dict):
        raise GrammarError(f"a JSON Schema must be an object, got {type(schema).__name__}")
    try:
        source = _llguidance().LLMatcher.grammar_from_json_schema(
            closed_objects(schema) if schema is not None else {"type": "object"}, overrides=JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(f"the JSON Schema cannot be compiled: {exc}") from exc
    return _compile(source, tokenizer, "JSON Schema" if schema is not None else "JSON object")


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's escapes are Lark's


class ToolSchema(NamedTuple):
    """A tool a grammar may call: its name, its parameters' JSON Schema (None: any object), and whether a keyword
    the engine cannot enforce is refused (`strict`, OpenAI's strict tools) or ignored (the call keeps its form)."""

    name: str
    parameters: dict[str, Any] | None
    strict: bool = True


def tool_call_grammar(tools: Sequence[tuple[Any, ...]], tokenizer: Any, head: str = "", tail: str = "", *,
                      more: str | None = None, json_answer: dict[str, Any] | None = None,
                      xml: bool = False) -> Grammar:
    """Calls of `tools` (`ToolSchema`s or `(name, parameters[, strict])` tuples) in the chat template's form: a call
    is `head` (`{name}`: the tool's name, as a JSON string unless `xml`), the arguments, then `tail`. `head` is
    what the prompt does not already hold of the first call: `{"name": ...` after a forced `<tool_call>\\n`,
    nothing after a forced start of a named call up to its arguments.

    The arguments are a JSON object valid against the tool's parameters, or with `xml` the Qwen3-Coder form: one
    `<parameter=NAME>\\nVALUE\\n</parameter>\\n` block per property in the schema's order (required ones always,
    the others optional), a string value as one line of text, any other as JSON valid against its property.
    `more`: further calls may follow, each after this text (the separator and what `head` lacks of a call's start,
    e.g. `\\n<tool_call>\\n`); None: exactly one call. `json_answer`: the answer may instead be a JSON value valid
    against this schema (a response format offered beside the tools). A call's arguments hold only the keys its
    tool lists (`closed_objects`)."""
    if not tools:
        raise GrammarError("a tool call grammar needs at least one tool")
    rules, alternatives = [], []
    for i, tool in enumerate(ToolSchema(*t) for t in tools):
        lead = head.format(name=tool.name if xml else json.dumps(tool.name))
        options = {**JSON_OPTIONS, "lenient": not tool.strict}
        parameters = closed_objects(tool.parameters) if tool.parameters is not None else {"type": "object"}
        pieces = _json_lexemes(lead) if json_answer is not None and not xml else [lead] * bool(lead)
        parts = [_lark_string(p) for p in pieces] + [f"args_{i}"] + [_lark_string(tail)] * bool(tail)
        rules.append(f"call_{i}: " + " ".join(parts))
        rules += _xml_arguments(f"args_{i}", parameters, options) if xml else \
            [f"args_{i}: %json {json.dumps({**parameters, 'x-guidance': options})}"]
        alternatives.append(f"call_{i}")
    calls = "call: " + " | ".join(alternatives)
    start = "call" if more is None else f"call ({_lark_string(more)} call)*"
    if json_answer is not None:
        rules.append(f"answer: %json {json.dumps({**closed_objects(json_answer), 'x-guidance': JSON_OPTIONS})}")
        start = f"({start}) | answer"
    lark = f"start: {start}\n{calls}\n" + "\n".join(rules) + "\n"
    try:
        source = _llguidance().LLMatcher.grammar_from_lark(lark)
    except ValueError as exc:
        raise GrammarError(f"the tool schemas cannot be compiled: {exc}") from exc
    return _compile(source, tokenizer, "tool parameters schema" + " or JSON answer" * (json_answer is not None))


# a JSON string, a separator as JSON_OPTIONS writes it, or a run of anything else
_LEXEME = re.compile(r'"(?:[^"\\]|\\.)*"|[:,] ?|[^":,]+')


def _json_lexemes(text: str) -> list[str]:
    """`text` (a call's JSON head, `{"name": "f", "parameters": `) cut where a JSON value's lexemes end. The grammar
    engine lexes greedily: a call head held as one literal beside a JSON answer that starts as it does (`{`, or
    `{"name"`) takes every answer's first bytes and then fails on the answer's key; cut alike, both stay open."""
    return _LEXEME.findall(text)


def _xml_arguments(rule: str, parameters: dict[str, Any], options: dict[str, Any]) -> list[str]:
    """Lark rules for one tool's arguments in the XML form (`tool_call_grammar`)."""
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    rules, parts = [], []
    for j, (name, prop) in enumerate(properties.items()):
        value = f"{rule}_{j}_value"
        prop = prop if isinstance(prop, dict) else {}
        if isinstance(prop.get("enum"), list) and prop["enum"]:
            rules.append(f"{value}: " + " | ".join(_lark_string(v if isinstance(v, str) else json.dumps(v))
                                                   for v in prop["enum"]))
        elif prop.get("type") == "string":
            rules.append(f"{value}: /[^\\n]*/")
        else:
            rules.append(f"{value}: %json {json.dumps({**prop, 'x-guidance': options})}")
        opening, closing = _lark_string(f"<parameter={name}>\n"), _lark_string("\n</parameter>\n")
        block = f"{opening} {value} {closing}"
        parts.append(block if name in required else f"({block})?")
    rules.append(f"{rule}: " + (" ".join(parts) if parts else '""'))
    return rules


# llguidance's errors for a grammar it gave up following (its parser's items at one position, its lexer's states
# or fuel: the limits `LLParserLimits` names; the matcher reports them as an "InternalError" with this text)
_TOO_COMPLEX = re.compile(r"Current row has \d+ items; max is|too many states|fuel exhausted")


class Matcher:
    """One request's position in its grammar, with rollback (exact mode undoes rejected drafts).

    Masks are `[vocab_size]` bools over the model's vocabulary (ids the tokenizer lacks are never allowed); the
    engine's EOS ids `eos_ids` are allowed exactly when the grammar may end here. With none (`ignore_eos`), the
    model's `end_ids` end the answer, allowed only where the grammar can only end (module docstring). `eos_ids`
    (the attribute): the tokens that end this request."""

    def __init__(self, grammar: Grammar, vocab_size: int, eos_ids: Sequence[int], end_ids: Sequence[int] = ()) -> None:
        self.grammar = grammar
        self._ll = _llguidance()
        self.m = self._ll.LLMatcher(grammar.tokenizer, grammar.source)
        self.vocab_size = vocab_size
        self.only_at_end = not eos_ids
        self.eos_ids = list(eos_ids) or list(end_ids)
        if not self.eos_ids:
            raise ValueError(f"a grammar's answer ends with an EOS, and neither the engine nor the model has an EOS "
                             f"id ({grammar.description})")
        self._bits = self._ll.torch.allocate_token_bitmask(1, grammar.tokenizer.vocab_size)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.forced_tokens = 0  # tokens committed because the grammar forced them (a request's stats)

    def _error(self) -> Exception:
        error = self.m.get_error()
        if _TOO_COMPLEX.search(error):
            return GrammarTooComplex(f"the {self.grammar.description} is too complex for the grammar engine to "
                                     "follow (too many alternatives open at once); simplify it (fewer "
                                     "anyOf/oneOf branches or patterns)")
        return RuntimeError(f"grammar matcher failed ({self.grammar.description}): {error}")

    def allowed(self) -> torch.Tensor:
        """`[vocab_size]` bool: the tokens the grammar allows next."""
        self._ll.torch.fill_next_token_bitmask(self.m, self._bits, 0)
        if self.m.is_error():  # the mask of a matcher that gave up (e.g. too complex) is empty: not a dead end
            raise self._error()
        bits = ((self._bits[0, :, None] >> self._shifts) & 1).bool().flatten()
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        n = min(self.vocab_size, bits.numel())
        out[:n] = bits[:n]
        eos = [e for e in self.eos_ids if e < self.vocab_size]
        out[eos] = self.m.is_stopped() if self.only_at_end else self.m.is_accepting()
        if not bool(out.any()):  # a dead end (not expected of a validated grammar): let the request end
            out[eos] = True
        return out

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance past `tokens` (EOS ids end the request and are not fed to the grammar)."""
        tokens = [t for t in tokens if t not in self.eos_ids]
        if tokens and not self.m.consume_tokens(tokens):
            raise self._error()

    def rollback(self, n: int) -> None:
        if n and not self.m.rollback(n):
            raise self._error()

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (consumed), then an EOS when it can only end."""
        tokens = list(self.m.compute_ff_tokens())
        self.consume(tokens)
        if self.m.is_stopped() and self.eos_ids:
            tokens.append(self.eos_ids[0])
        self.forced_tokens += len(tokens)
        return tokens

    def masks_for(self, drafts: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Masks `[1 + len(drafts), vocab_size]` for deciding the next token and the token after each draft,
        consuming the drafts the grammar allows; the positions after the first disallowed draft are unreachable
        (that draft is rejected there) and left unmasked. Returns the masks and how many drafts were consumed."""
        masks = torch.ones(1 + len(drafts), self.vocab_size, dtype=torch.bool)
        for i, d in enumerate(drafts):
            masks[i] = self.allowed()
            if not masks[i, d] or d in self.eos_ids:
                return masks, i
            self.consume([d])
        masks[len(drafts)] = self.allowed()
        return masks, len(drafts)

    def draft(self, logits: torch.Tensor) -> list[int]:
        """The drafter's choice `[m]` for the next `m` positions (`logits` `[m, V]`): the argmax among the
        allowed tokens at each position given the drafts before it; the state is left unchanged."""
        return draft_through(self, logits,
                             lambda row: int(row.float().masked_fill(~self.allowed(), float("-inf")).argmax()))


def draft_through(constraint: Any, logits: torch.Tensor, choose: Callable[[torch.Tensor], int]) -> list[int]:
    """Drafts `[m]` for the next `m` positions (`logits` `[m, V]`) under a token-level constraint (a grammar's
    `Matcher`, a thinking budget's tracker: `consume`, `rollback`, `eos_ids`): `choose(row)` picks each position's
    token with the constraint advanced past the drafts before it; an EOS ends them; the constraint is left as it
    was."""
    out: list[int] = []
    for row in logits:
        choice = choose(row)
        out.append(choice)
        if choice in constraint.eos_ids:
            break
        constraint.consume([choice])
    constraint.rollback(len([t for t in out if t not in constraint.eos_ids]))
    return out
