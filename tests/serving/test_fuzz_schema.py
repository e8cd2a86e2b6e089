"""The server fuzzed against its own OpenAPI schema, on a small budget (benchmarks/bench_fuzz.py runs the same code
on a large one): schemathesis' valid and invalid requests for every route, the stored responses' life
(create, retrieve, continue, delete, then the deleted id again), and random mutations of valid bodies. No 5xx,
every response valid against the schema, the server alive after."""

from __future__ import annotations

import json

import httpx
import pytest

from script_helpers import ROOT, load_script
from server_helpers import build_checkpoint, server_process

pytest.importorskip("schemathesis")
fuzz = load_script(ROOT / "benchmarks" / "bench_fuzz.py", "bench_fuzz")
NAME = "fuzz"


@pytest.fixture(scope="module")
def server(tmp_path_factory, chat_tokenizer):
    model_dir = build_checkpoint(tmp_path_factory.mktemp("fuzz") / "model", chat_tokenizer)
    with server_process(model_dir, "--api-key", fuzz.KEY, "--prefix-cache-mb", "8", "--responses-store-mb", "2",
                        name=NAME) as (url, proc):
        yield url, proc


def test_generated_requests_get_no_5xx_and_answers_of_the_schema(server):
    url, proc = server
    tally = fuzz.Tally()
    fuzz.fuzz_schema(url, NAME, examples=6, seed=0, tally=tally)
    fuzz.response_chains(url, NAME, tally, rounds=2)
    assert not tally.server_errors, tally.server_errors[:3]
    assert not tally.invalid, tally.invalid[:3]
    assert tally.requests >= 40 and httpx.get(f"{url}/health").status_code == 200


def test_metrics_is_documented_as_the_text_it_answers(server):
    url, _ = server
    tally = fuzz.Tally()
    fuzz.fuzz_schema(url, NAME, examples=1, seed=0, tally=tally, only="/metrics")
    assert not tally.invalid, tally.invalid


def test_mutated_bodies_get_400s_with_a_code_never_a_5xx(server):
    url, _ = server
    tally = fuzz.Tally()
    fuzz.fuzz_mutations(url, NAME, count=80, seed=1, tally=tally, longest=10_000)
    assert not tally.server_errors and not tally.invalid, (tally.server_errors + tally.invalid)[:3]
    assert sum(n for k, n in tally.statuses.items() if k.endswith(" 400")) >= 40
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
])
def test_streamed_answers_are_documented_as_event_streams(server, path, body):
    """`stream: true` answers `text/event-stream`: the schema says so, so a client generated from it (and
    schemathesis' content-type check) accepts the answer."""
    import schemathesis
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

    url, _ = server
    headers = {"Authorization": f"Bearer {fuzz.KEY}"}
    schema = schemathesis.openapi.from_dict(httpx.get(f"{url}/openapi.json", headers=headers).json())
    case = schema[path]["POST"].Case(body={"model": NAME, "stream": True, **body})
    response = case.call(base_url=url, headers=headers, timeout=60)
    assert response.headers["content-type"][0].startswith("text/event-stream")
    try:
        case.validate_response(response, checks=[content_type_conformance, response_schema_conformance],
                               headers=headers)
    except FailureGroup as exc:
        pytest.fail(str(exc)[:600])


def test_mutated_bodies_keep_a_token_limit():
    """A mutation that drops the token limit, or sets it to null, would let a random model write to the end of its
    context (a minute a request on one thread): the fuzz puts `MAX_NEW` back; a limit of a wrong type or beyond
    the context stays (a 400 to test). (A byte edit that renames the key is bounded by the served context.)"""
    import random

    rng = random.Random(0)
    sent_bodies = 0
    for route, bodies in fuzz.valid_bodies(NAME).items():
        for body in bodies:
            for _ in range(100):
                try:
                    sent = json.loads(fuzz.mutate(body, rng, longest=10_000))
                except (ValueError, RecursionError):  # broken or deep JSON: a 400 before any generation
                    continue
                if isinstance(sent, dict) and set(sent) <= set(body):  # else a byte edit may have renamed the key
                    assert sent.get(fuzz.LIMIT_OF[route]) is not None, sent
                    sent_bodies += 1
    assert sent_bodies > 500
