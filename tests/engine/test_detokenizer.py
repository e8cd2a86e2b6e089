"""`StopAwareDetokenizer`: what a streaming front end sends, piece by piece, around stop strings."""

from __future__ import annotations

from clover.engine import IncrementalDetokenizer
from clover.engine.detokenizer import StopAwareDetokenizer

VOCAB: list[str] = []  # token id -> its text; grown by `_ids`, so a test writes its tokens as strings


def _decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def _ids(*tokens: str) -> list[int]:
    for t in tokens:
        if t not in VOCAB:
            VOCAB.append(t)
    return [VOCAB.index(t) for t in tokens]


def _run(stops: tuple[str, ...], pieces: list[list[str]], stop_string: str | None) -> tuple[list[str], str]:
    """Push `pieces` (the last one finishing the request, ended by `stop_string`); the deltas and the final text."""
    detok = StopAwareDetokenizer(_decode, stops)
    deltas = [detok.push(_ids(*p)) for p in pieces[:-1]]
    deltas.append(detok.push(_ids(*pieces[-1]), finished=True, stop_string=stop_string))
    assert "".join(deltas) == detok.text
    return deltas, detok.text


def test_stop_string_split_across_pieces_is_never_sent() -> None:
    # "ST" may begin "STOP": held back, then cut with the rest once the stop string is complete
    deltas, text = _run(("STOP",), [["hel", "lo", " S", "T"], ["OP", " tail"]], "STOP")
    assert deltas == ["hello", " "] and text == "hello "


def test_stop_string_inside_the_last_token_cuts_what_follows_it() -> None:
    deltas, text = _run(("STOP",), [["one", " two"], [" ST", "OPthree"]], "STOP")
    assert text == "one two " and not any("S" in d for d in deltas)


def test_stop_string_at_the_very_start() -> None:
    deltas, text = _run(("STOP",), [["S", "T"], ["OP"]], "STOP")
    assert deltas == ["", ""] and text == ""


def test_multiple_stop_strings_hold_back_the_longest_and_cut_at_the_one_that_ended_it() -> None:
    # before the end, the last len("END") - 1 = 2 characters wait: they might begin either stop string
    deltas, text = _run(("\n\n", "END"), [["ab", "c\n"], ["x", "E"], ["N", "D"]], "END")
    assert deltas == ["ab", "c\n", "x"] and text == "abc\nx"
    deltas, text = _run(("\n\n", "END"), [["ab", "c\n"], ["\nEND"]], "\n\n")
    assert deltas == ["ab", "c"] and text == "abc"


def test_no_stop_strings_sends_everything_at_once() -> None:
    deltas, text = _run((), [["a", "b"], ["c"], ["d", "e"]], None)
    assert deltas == ["ab", "c", "de"] and text == "abcde"


def test_held_back_text_is_released_when_the_request_ends_otherwise() -> None:
    # ended by EOS or length: the tail that looked like the start of a stop string was just text
    deltas, text = _run(("STOP",), [["abc", "ST"], []], None)
    assert deltas == ["ab", "cST"] and text == "abcST"


def test_incremental_detokenizer_waits_for_whole_characters() -> None:
    data = "héllo wörld ✓".encode()
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731  byte-level "tokenizer"
    detok = IncrementalDetokenizer(decode)
    pieces = [detok.push(list(data[i : i + 3])) for i in range(0, len(data), 3)]
    pieces.append(detok.flush())
    assert "".join(pieces) == "héllo wörld ✓"
    assert all("\ufffd" not in p for p in pieces)
