"""Hypothesis property tests of the parsers against their references: a tool-call format's answer however the
stream splits it gives the whole answer's calls (and the calls written), DRY's lag-match penalty equals its
brute-force definition (`naive_dry_penalty`) on any history, and stop strings found block by block and streamed
give the text of their naive definition (`naive_stop_text`)."""

from __future__ import annotations

import json

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clover.assistant_output import OutputParser, whole_calls
from clover.engine.detokenizer import StopAwareDetokenizer
from clover.engine.request import Sequence
from clover.engine.request import RequestOptions
from clover.engine.constraints.repetition import (DryConfig, LagMatches, breakers_from_texts, dry_candidates,
                                                  lag_matches,
                                      naive_dry_penalty, penalty_of)
from clover.tool_formats import TOOL_FORMATS

NAMES = st.sampled_from(["f", "get_weather", "tool_2"])
KEYS = st.sampled_from(["a", "city", "n"])
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
VALUES = st.one_of(st.integers(-10**6, 10**6), TEXT.filter(lambda s: "\n" not in s and "<" not in s))
CALLS = st.lists(st.tuples(NAMES, st.dictionaries(KEYS, VALUES, max_size=3)), min_size=1, max_size=3)
SCHEMAS = {name: {"type": "object", "properties": {"a": {"type": "integer"}, "city": {"type": "string"},
                                                  "n": {"type": "integer"}}} for name in ("f", "get_weather", "tool_2")}


def written(fmt: str, calls: list[tuple[str, dict]]) -> str:
    """`calls` as the format writes them (XML values typed by SCHEMAS: strings as text, integers as JSON)."""
    if fmt == "hermes":
        return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>'
                         for n, a in calls)
    if fmt == "qwen3_coder":
        return "\n".join(f"<tool_call>\n<function={n}>\n" + "".join(
            f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items()) + "</function>\n</tool_call>"
            for n, a in calls)
    return "; ".join(f'{{"name": "{n}", "parameters": {json.dumps(a)}}}' for n, a in calls)


def _typed(calls: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """What the XML format can carry: a value is typed by its key's schema (a string key's integer is its text)."""
    return [(n, {k: (str(v) if k == "city" else v) for k, v in a.items()}) for n, a in calls]


def _parse(fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    parser = OutputParser(tools=True, tool_format=TOOL_FORMATS[fmt], schemas=SCHEMAS)
    content, deltas = "", []
    for piece in pieces:
        d = parser.feed(piece)
        content, deltas = content + d.content, deltas + d.tool_calls
    d = parser.finish()
    return content + d.content, [(c["name"], json.loads(c["arguments"])) for c in whole_calls(deltas + d.tool_calls)]


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(sorted(TOOL_FORMATS)), calls=CALLS, cuts=st.lists(st.integers(0, 10**4), max_size=8))
def test_any_split_of_a_formats_calls_parses_as_the_whole(fmt, calls, cuts):
    if fmt == "qwen3_coder":  # a string value that looks like an integer is still text: the schema says string
        calls = _typed(calls)
        calls = [(n, {k: v for k, v in a.items() if k == "city" or isinstance(v, int)}) for n, a in calls]
    else:
        calls = [(n, {k: v for k, v in a.items()}) for n, a in calls]
    text = written(fmt, calls)
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    whole = _parse(fmt, [text])
    assert _parse(fmt, pieces) == whole
    assert whole == ("", calls), text


TOY = ["a", "b", "c", "\n", "x:", "y", "z", "ab", "q", "r", "s\n", "t"]  # token texts of a toy vocabulary


@settings(max_examples=150, deadline=None)
@given(history=st.lists(st.integers(0, len(TOY) - 1).map(lambda t: t if t < 3 or t in (3, 4, 5) else t % 3),
                        min_size=1, max_size=40),
       allowed=st.integers(1, 3), last_n=st.sampled_from([-1, 4, 9, 30]), base=st.sampled_from([1.0, 1.75, 3.0]),
       breakers=st.sampled_from([(), ("\n",), ("\n", ":"), ("y\n",)]))
def test_dry_penalty_from_lag_matches_equals_its_definition(history, allowed, last_n, base, breakers):
    cfg = DryConfig(0.8, base, allowed, last_n, breakers_from_texts(TOY, breakers))
    state = LagMatches(history[:1], cfg.window)
    state.extend(history[1:])  # the per-token update, against the whole history's Z-array below
    tail = history[-cfg.window:] if cfg.window else history
    # a lag's match may reach back before the window; what the window holds of it is its Z-array value
    assert [min(m, len(tail) - d) for d, m in enumerate(state.lags.tolist(), 1)] == lag_matches(tail)
    single = cfg.breakers.single_ids()
    tokens, lengths = dry_candidates(state, cfg, single, lambda: list(history))
    best: dict[int, int] = {}
    for t, n in zip(tokens.tolist(), lengths.tolist()):
        if t not in single:
            best[t] = max(best.get(t, 0), n)
    fast = torch.zeros(len(TOY))
    for t, n in best.items():
        fast[t] = penalty_of(torch.tensor(n), cfg)
    assert torch.allclose(fast, naive_dry_penalty(history, cfg, len(TOY)))


# a byte-level toy vocabulary: whole characters, multi-character pieces, and the single bytes of 2- and 4-byte
# characters (a character split across tokens decodes to U+FFFD until its last byte)
BYTES = [b"a", b"b", b"ab", b"ba", b"\n", b"</", b"s>", b" ", b"\xc3", b"\xa9", "é".encode(), b"\xf0\x9f",
         b"\x98\x80", "😀".encode(), b"aab"]


def toy_decode(ids: list[int]) -> str:
    return b"".join(BYTES[i] for i in ids).decode("utf-8", errors="replace")


def naive_stop_text(ids: list[int], stops: list[str]) -> str:
    """The definition: the shortest prefix of `ids` whose whole text holds a stop string ends the answer, cut before
    that string (the first of `stops` it holds, as vLLM reads the list); no such prefix: the whole text."""
    for k in range(1, len(ids) + 1):
        text = toy_decode(ids[:k])
        found = [s for s in stops if s in text]
        if found:
            return text[:text.index(found[0])]
    return toy_decode(ids)


STOPS = st.lists(st.sampled_from(["a", "ab", "ba", "b\n", "</s>", "é", "aé", "😀", "😀a", "bbb", " a"]),
                 min_size=1, max_size=3, unique=True)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, len(BYTES) - 1), min_size=1, max_size=40), stops=STOPS,
       cuts=st.lists(st.integers(1, 6), max_size=20))
def test_stop_strings_found_by_blocks_and_streamed_give_the_naive_text(ids, stops, cuts):
    """The engine finds a stop string block by block from a short tail of text (`Sequence.append_block`), the
    stream holds back what may grow into one (`StopAwareDetokenizer`): whatever the blocks, the streamed text is
    the naive definition's, and the answer ends where that definition ends it."""
    request = Sequence(0, [1], RequestOptions.of(stop=tuple(stops)), max_new_tokens=len(ids))
    stream = StopAwareDetokenizer(toy_decode, stops)
    sent, at = "", 0
    for size in [*cuts, len(ids)]:
        if request.finished or at >= len(ids):
            break
        piece = request.append_block(ids[at:at + size], steps=1, forwards=1, eos_ids=(), detokenize=toy_decode)
        at += size
        sent += stream.push(piece, finished=request.finished, stop_string=request.stop_string)
    assert request.finished
    assert sent == naive_stop_text(ids, stops), (request.generated, request.stop_string)
    assert (request.finish_reason == "stop") == any(s in toy_decode(ids) for s in stops)
