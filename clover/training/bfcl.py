"""Berkeley Function Calling Leaderboard (BFCL) data as tool-calling chats, and BFCL's AST match.

The data ships with the `bfcl-eval` package (installed ``--no-deps``; it is read, never imported):
``bfcl_eval/data/BFCL_v<N>_<category>.json`` holds one question per line (``id``, ``question``: a list of
turns, each a list of messages, and ``function``: the function docs, JSON schemas whose types are BFCL's
Python names), and ``data/possible_answer/`` the accepted answers (``ground_truth``: one
``{function_name: {arg: [accepted values]}}`` per expected call; ``""`` among the accepted values means the
argument may be left out; a dict value is again ``{key: [accepted values]}``).

Splits:
- ``train`` / ``eval``: the non-live Python categories `TRAIN_CATEGORIES` (simple_python, multiple,
  parallel, parallel_multiple — the Java/JavaScript ones hold code strings, not JSON values). An example is in
  ``eval`` when the first 8 hex digits of sha256(id), as an integer, are 0 modulo 10 (`EVAL_MODULUS`), else in
  ``train``: deterministic, about 10 %, and stable when examples are added.
- ``live_simple``: user-contributed data, evaluation only. `ensure_trainable` refuses every category outside
  `TRAIN_CATEGORIES` (all ``live_*`` included) for the train split.

A chat is ``{"id", "category", "messages", "tools", "possible_answer"}``: the question's messages, then one
assistant turn whose `tool_calls` take the first accepted value of every argument (optional arguments that
may be left out are left out), and the tools in OpenAI function format (BFCL ``dict`` -> ``object``,
``float`` -> ``number``, ``tuple`` -> ``array``, ``any`` -> no type). The prompt for evaluation is
``messages[:-1]``; score a model's calls with `tool_call_matches(calls, chat["possible_answer"])`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover.choices import BFCL_SPLITS as SPLITS, TRAIN_CATEGORIES

EVAL_ONLY_CATEGORIES = ("live_simple",)
EVAL_MODULUS = 10  # 1 in 10 examples of TRAIN_CATEGORIES is held out for evaluation
_ALIASES = {"simple": "simple_python"}
_FILE_RE = re.compile(r"^BFCL_v(\d+)_(.+)\.json$")
_TYPE_MAP = {"dict": "object", "float": "number", "tuple": "array"}


@dataclass(frozen=True)
class BFCLExample:
    id: str
    category: str
    messages: list[dict[str, Any]]  # the question's turns, flattened
    functions: list[dict[str, Any]]  # BFCL function docs, as shipped
    possible_answer: list[dict[str, dict[str, list[Any]]]]  # one {name: {arg: [accepted]}} per expected call


# -- files -----------------------------------------------------------------------------------------------------------
def bfcl_data_dir() -> Path:
    """``bfcl_eval/data`` of the installed `bfcl-eval` package."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("bfcl-eval is not installed; `pip install --no-deps bfcl-eval`")
    return Path(spec.submodule_search_locations[0]) / "data"


def _category_files(directory: Path) -> dict[str, Path]:
    """category -> file of the newest BFCL version present in `directory`."""
    found: dict[str, tuple[int, Path]] = {}
    for path in directory.glob("BFCL_v*_*.json"):
        match = _FILE_RE.match(path.name)
        if match and int(match[1]) >= found.get(match[2], (-1, path))[0]:
            found[match[2]] = (int(match[1]), path)
    return {category: path for category, (_, path) in found.items()}


def bfcl_categories() -> list[str]:
    """Categories that have both questions and accepted answers."""
    data = bfcl_data_dir()
    return sorted(set(_category_files(data)) & set(_category_files(data / "possible_answer")))


def _read_lines(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: invalid JSON ({exc})") from None
    return rows


def load_bfcl(category: str) -> list[BFCLExample]:
    """The examples of one BFCL category (e.g. "simple_python", "parallel", "live_simple"; "simple" works too)."""
    category = _ALIASES.get(category, category)
    data = bfcl_data_dir()
    questions, answers = _category_files(data).get(category), _category_files(data / "possible_answer").get(category)
    if questions is None or answers is None:
        raise ValueError(f"unknown BFCL category {category!r}; available: {bfcl_categories()}")
    truth = {row["id"]: row["ground_truth"] for row in _read_lines(answers)}
    examples = []
    for row in _read_lines(questions):
        if row["id"] not in truth:
            raise ValueError(f"{answers}: no accepted answer for {row['id']!r}")
        messages = [dict(m) for turn in row["question"] for m in turn]
        examples.append(BFCLExample(row["id"], category, messages, row["function"], truth[row["id"]]))
    return examples


# -- splits ----------------------------------------------------------------------------------------------------------
def split_of(example_id: str) -> str:
    """"eval" for the deterministic 1-in-`EVAL_MODULUS` held-out examples (by sha256 of the id), else "train"."""
    digest = hashlib.sha256(example_id.encode("utf-8")).hexdigest()
    return "eval" if int(digest[:8], 16) % EVAL_MODULUS == 0 else "train"


def ensure_trainable(category: str) -> None:
    """Raise unless `category` may feed a training split: never ``live_*``, never anything unconverted."""
    if category.startswith("live_") or category in EVAL_ONLY_CATEGORIES:
        raise ValueError(f"BFCL category {category!r} is evaluation-only; it never goes into training data")
    if category not in TRAIN_CATEGORIES:
        raise ValueError(f"BFCL category {category!r} is not a training category; valid: {list(TRAIN_CATEGORIES)}")


# -- conversion ------------------------------------------------------------------------------------------------------
def _convert_schema(schema: Any) -> Any:
    """A BFCL parameter schema as JSON Schema: dict/float/tuple -> object/number/array, `any` -> untyped."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type":
            if value != "any":
                out[key] = _TYPE_MAP.get(value, value)
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _convert_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = _convert_schema(value)
        else:
            out[key] = value
    return out


def bfcl_tools(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """BFCL function docs as OpenAI tools ``{"type": "function", "function": {name, description, parameters}}``."""
    return [{"type": "function", "function": {**fn, "parameters": _convert_schema(fn.get("parameters", {}))}}
            for fn in functions]


def _choose(accepted: list[Any], required: bool) -> tuple[bool, Any]:
    """(present, value): the first accepted value, or absent when the argument may be left out."""
    values = [v for v in accepted if v != ""]
    if not values or ("" in accepted and not required):
        return False, None
    return True, _materialise(values[0])


def _materialise(value: Any) -> Any:
    """An accepted value with its nested ``{key: [accepted]}`` dicts resolved to first choices."""
    if isinstance(value, dict):
        out = {}
        for key, accepted in value.items():
            present, chosen = _choose(accepted, required=False) if isinstance(accepted, list) else (True, accepted)
            if present:
                out[key] = chosen
        return out
    if isinstance(value, list):
        return [_materialise(v) for v in value]
    return value


def reference_tool_calls(example: BFCLExample) -> list[dict[str, Any]]:
    """The expected calls as OpenAI tool calls (ids ``call_<i>``, arguments a JSON string)."""
    required = {fn["name"]: set(fn.get("parameters", {}).get("required", [])) for fn in example.functions}
    calls = []
    for i, call in enumerate(example.possible_answer):
        (name, spec), = call.items()
        args = {}
        for arg, accepted in spec.items():
            present, value = _choose(accepted, arg in required.get(name, set()))
            if present:
                args[arg] = value
        calls.append({"id": f"call_{i}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
    return calls


def bfcl_to_chats(split: str = "train", categories: list[str] | tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Chats (module docstring) of one split: "train", "eval" (held out of `TRAIN_CATEGORIES`) or "live_simple".

    `categories` narrows "train"/"eval" to some of `TRAIN_CATEGORIES`; anything else is refused.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown BFCL split {split!r}; valid: {list(SPLITS)}")
    if split == "live_simple":
        if categories is not None and list(categories) != ["live_simple"]:
            raise ValueError("the live_simple split holds the live_simple category only")
        categories = ["live_simple"]
    else:
        categories = [_ALIASES.get(c, c) for c in (categories or TRAIN_CATEGORIES)]
        for category in categories:
            ensure_trainable(category)
    chats = []
    for category in categories:
        for ex in load_bfcl(category):
            if split != "live_simple" and split_of(ex.id) != split:
                continue
            if split == "train":
                ensure_trainable(ex.category)
            assistant = {"role": "assistant", "content": "", "tool_calls": reference_tool_calls(ex)}
            chats.append({"id": ex.id, "category": ex.category, "messages": [*ex.messages, assistant],
                          "tools": bfcl_tools(ex.functions), "possible_answer": ex.possible_answer})
    return chats


# -- matching ---------------------------------------------------------------------------------------------------------
def standardize_string(text: str) -> str:
    """BFCL's string normalisation: drop spaces and ``,./-_*^``, lower-case, ``'`` -> ``"``."""
    return re.sub(r"[ ,./\-_*^]", "", text).lower().replace("'", '"')


def _value_matches(value: Any, accepted: Any) -> bool:
    if isinstance(accepted, dict):  # nested answer: {key: [accepted values]}
        return isinstance(value, dict) and _args_match(value, accepted)
    if isinstance(accepted, (list, tuple)):
        return (isinstance(value, (list, tuple)) and len(value) == len(accepted)
                and all(_value_matches(v, a) for v, a in zip(value, accepted)))
    if isinstance(accepted, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(accepted, bool) and value == accepted
    if isinstance(accepted, (int, float)):
        return isinstance(value, (int, float)) and value == accepted
    if isinstance(accepted, str):
        return isinstance(value, str) and standardize_string(value) == standardize_string(accepted)
    return value == accepted


def _args_match(args: dict[str, Any], spec: dict[str, Any]) -> bool:
    """Every given argument has an accepted value; every argument not given may be left out."""
    spec = {k: v if isinstance(v, list) else [v] for k, v in spec.items()}
    for key, value in args.items():
        if key not in spec or not any(_value_matches(value, a) for a in spec[key]):
            return False
    return all(key in args or "" in accepted for key, accepted in spec.items())


def _normalize_call(call: Any) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of an OpenAI tool call, a ``{"name", "arguments"}`` object or a BFCL ``{name: args}``."""
    if not isinstance(call, dict):
        return None
    fn = call.get("function", call)
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        name, args = fn["name"], fn.get("arguments", {})
    elif len(call) == 1 and isinstance(next(iter(call.values())), dict):
        (name, args), = call.items()
    else:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    return (name, args) if isinstance(args, dict) else None


def tool_call_matches(predicted_calls: list[Any], possible_answer: list[dict[str, dict[str, list[Any]]]]) -> bool:
    """BFCL-style AST match of a model's tool calls against a BFCL ``ground_truth``.

    True when the calls pair one-to-one (in any order) with the expected calls such that each pair has the
    same function name (exactly; no ``.`` -> ``_`` rewriting), every argument the call gives is among the
    expected call's arguments with an accepted value, and every expected argument it leaves out may be left
    out (``""`` accepted). Values: strings compare after `standardize_string`; numbers by value (int and
    float interchangeable; booleans are not numbers); lists element by element; dicts key by key against the
    nested accepted values. Simpler than BFCL: no type check against the schema, and the rules apply at every
    nesting depth. Calls may be OpenAI tool calls (arguments as a JSON string or object) or BFCL
    ``{name: {arg: value}}`` objects; a call that cannot be read makes the match fail.
    """
    calls = [_normalize_call(c) for c in predicted_calls]
    if any(c is None for c in calls) or len(calls) != len(possible_answer):
        return False
    expected = [next(iter(answer.items())) for answer in possible_answer]

    def assign(remaining: list[tuple[str, dict[str, Any]]], todo: list[tuple[str, dict[str, Any]]]) -> bool:
        if not todo:
            return not remaining
        name, spec = todo[0]
        return any(n == name and _args_match(args, spec) and assign(remaining[:i] + remaining[i + 1:], todo[1:])
                   for i, (n, args) in enumerate(remaining))

    return assign(calls, expected)  # type: ignore[arg-type]
