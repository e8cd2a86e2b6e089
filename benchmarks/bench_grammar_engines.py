"""Grammar engines for structured outputs, compared on this machine: schema compile time, mask time per token and
JSON Schema coverage, with SmolLM2's tokenizer (clover-smol's). Prints one table; docs/structured.md records it.

    python benchmarks/bench_grammar_engines.py [--tokenizer DIR] [--repeat 3]

Candidates: llguidance, xgrammar, outlines-core (each skipped when not importable). Mask time: the schema's
example answer is tokenized and fed token by token; before each token the engine computes the allowed-token mask
(what a decoding step needs), and the mean over the answer's tokens is reported. Coverage: which of the schemas
below the engine compiles and then accepts the example answer of (an engine that compiles a keyword it does not
enforce, e.g. `uniqueItems`, counts as compiling it: docs/structured.md notes which do).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

STR, INT = {"type": "string"}, {"type": "integer"}
# (name, schema, an instance valid against it)
SCHEMAS: list[tuple[str, dict[str, Any], Any]] = [
    ("object", {"type": "object", "properties": {"name": STR, "age": INT}, "required": ["name", "age"]},
     {"name": "Ada Lovelace", "age": 36}),
    ("defs_ref", {"$defs": {"Item": {"type": "object", "properties": {"sku": STR, "qty": INT},
                                     "required": ["sku", "qty"]}},
                  "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
                                                   "note": {"anyOf": [STR, {"type": "null"}]}},
                  "required": ["items", "note"]},
     {"items": [{"sku": "A-1", "qty": 2}, {"sku": "B-7", "qty": 1}], "note": None}),
    ("optional", {"type": "object", "properties": {"a": STR, "b": INT}, "required": ["a"]}, {"a": "x", "b": 3}),
    ("anyOf_objects", {"anyOf": [{"type": "object", "properties": {"cat": STR}, "required": ["cat"]},
                                 {"type": "object", "properties": {"dog": INT}, "required": ["dog"]}]}, {"dog": 4}),
    ("enum_const", {"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]}, "v": {"const": 1}},
                    "required": ["kind", "v"]}, {"kind": "b", "v": 1}),
    ("recursive", {"$defs": {"Node": {"type": "object", "properties": {
        "value": INT, "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
        "required": ["value", "children"]}}, "$ref": "#/$defs/Node"},
     {"value": 1, "children": [{"value": 2, "children": []}]}),
    ("formats", {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                                  "mail": {"type": "string", "format": "email"},
                                                  "id": {"type": "string", "format": "uuid"}},
                 "required": ["when", "mail", "id"]},
     {"when": "2025-01-02T03:04:05Z", "mail": "a@b.co", "id": "123e4567-e89b-12d3-a456-426614174000"}),
    ("pattern", {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"}},
                 "required": ["code"]}, {"code": "ABC-12"}),
    ("bounds", {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 5},
                                                 "n": {"type": "integer", "minimum": 3, "maximum": 70},
                                                 "x": {"type": "number", "exclusiveMinimum": 0}},
                "required": ["s", "n", "x"]}, {"s": "abc", "n": 42, "x": 0.5}),
    ("array_bounds", {"type": "array", "items": INT, "minItems": 1, "maxItems": 3}, [1, 2]),
    ("dict", {"type": "object", "additionalProperties": INT}, {"a": 1, "b": 2}),
    ("oneOf", {"oneOf": [STR, INT]}, 5),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": INT}, "required": ["a"]},
                         {"type": "object", "properties": {"b": INT}, "required": ["b"]}]}, {"a": 1, "b": 2}),
    ("prefixItems", {"type": "array", "prefixItems": [STR, INT], "items": False}, ["a", 1]),
    ("patternProperties", {"type": "object", "patternProperties": {"^x_": INT}}, {"x_a": 1}),
    ("uniqueItems", {"type": "array", "items": INT, "uniqueItems": True}, [1, 2]),
    ("if_then", {"type": "object", "properties": {"a": INT}, "if": {"properties": {"a": {"const": 1}}},
                 "then": {"required": ["a"]}}, {"a": 1}),
]


class Candidate:
    """One engine: `compile(schema)` -> a state factory; a state has `mask()` and `advance(token)`."""

    name = ""

    def compile(self, schema: dict[str, Any]) -> Callable[[], Any]:
        raise NotImplementedError


class LLGuidance(Candidate):
    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, self.tok.vocab_size)

    def compile(self, schema: dict[str, Any]) -> Callable[[], Any]:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        failed, messages = self.ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tok)
        if failed:
            raise ValueError(messages[0])
        outer = self

        class State:
            def __init__(self) -> None:
                self.m = outer.ll.LLMatcher(outer.tok, grammar)

            def mask(self) -> None:
                outer.llt.fill_next_token_bitmask(self.m, outer.bitmask, 0)

            def advance(self, t: int) -> None:
                assert self.m.consume_token(t), self.m.get_error()

        State()  # the matcher's first use builds what a compile builds in the other engines (lazily)
        return State


class XGrammar(Candidate):
    name = "xgrammar"

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar

        self.x = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def compile(self, schema: dict[str, Any]) -> Callable[[], Any]:
        compiled = self.compiler.compile_json_schema(json.dumps(schema), strict_mode=False)
        outer = self

        class State:
            def __init__(self) -> None:
                self.m = outer.x.GrammarMatcher(compiled)

            def mask(self) -> None:
                self.m.fill_next_token_bitmask(outer.bitmask)

            def advance(self, t: int) -> None:
                assert self.m.accept_token(t)

        return State


class OutlinesCore(Candidate):
    name = "outlines-core"

    def __init__(self, tokenizer: Any) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.regex = outlines_core, build_regex_from_schema
        vocab: dict[str, list[int]] = {}
        for token, i in tokenizer.get_vocab().items():
            if i != tokenizer.eos_token_id:
                vocab.setdefault(token, []).append(i)
        self.vocab = outlines_core.Vocabulary(tokenizer.eos_token_id, vocab)
        self.mask_t = torch.zeros((len(tokenizer) + 31) // 32, dtype=torch.int32)

    def compile(self, schema: dict[str, Any]) -> Callable[[], Any]:
        index = self.oc.Index(self.regex(json.dumps(schema)), self.vocab)
        outer = self

        class State:
            def __init__(self) -> None:
                self.g = outer.oc.Guide(index)

            def mask(self) -> None:
                self.g.write_mask_into(outer.mask_t.data_ptr(), outer.mask_t.numel(), outer.mask_t.element_size())

            def advance(self, t: int) -> None:
                self.g.advance(t)

        return State


def measure(candidate: Candidate, tokenizer: Any, repeat: int) -> list[dict[str, Any]]:
    rows = []
    for name, schema, instance in SCHEMAS:
        # outlines-core's regex has no optional whitespace: its answer is compact
        text = json.dumps(instance, separators=(",", ":") if candidate.name == "outlines-core" else None)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        try:
            compile_s = []
            for _ in range(repeat):
                start = time.perf_counter()
                factory = candidate.compile(schema)
                compile_s.append(time.perf_counter() - start)
            mask_s = []
            for _ in range(repeat):
                state = factory()
                for t in ids:
                    start = time.perf_counter()
                    state.mask()
                    mask_s.append(time.perf_counter() - start)
                    state.advance(t)
            rows.append({"schema": name, "ok": True, "compile_ms": 1e3 * statistics.median(compile_s),
                         "mask_us": 1e6 * statistics.mean(mask_s)})
        except Exception as exc:  # noqa: BLE001 - an engine's refusal is the measurement
            rows.append({"schema": name, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:80]}"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer directory (default: clover-smol's)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from clover.tokenizer import load_tokenizer

    if args.tokenizer is None:
        from clover.smol import base_dir
        args.tokenizer = base_dir()
    tokenizer = load_tokenizer(args.tokenizer)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; "
          f"tokenizer {args.tokenizer.name} ({len(tokenizer)} tokens)")
    for cls in (LLGuidance, XGrammar, OutlinesCore):
        try:
            start = time.perf_counter()
            candidate = cls(tokenizer)
            setup = time.perf_counter() - start
        except ImportError as exc:
            print(f"{cls.name}: not installed ({exc})")
            continue
        rows = measure(candidate, tokenizer, args.repeat)
        ok = [r for r in rows if r["ok"]]
        summary = (f"median compile {statistics.median([r['compile_ms'] for r in ok]):.1f} ms; "
                   f"mean mask {statistics.mean([r['mask_us'] for r in ok]):.0f} us/token") if ok else ""
        print(f"\n{cls.name}: tokenizer setup {setup * 1e3:.0f} ms; compiles {len(ok)}/{len(rows)} schemas; {summary}")
        for r in rows:
            print(f"  {r['schema']:<18} " + (f"compile {r['compile_ms']:9.1f} ms  mask {r['mask_us']:8.0f} us"
                                             if r["ok"] else f"FAILED {r['error']}"))


if __name__ == "__main__":
    main()
