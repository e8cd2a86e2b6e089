"""The server fuzzed against its own OpenAPI schema, on a small budget (benchmarks/bench_fuzz.py runs the same code
on a large one): schemathesis' valid and invalid requests for every route, the stored responses' life
(create, retrieve, continue, delete, then the deleted id again), and random mutations of valid bodies. No 5xx,
every response valid against the schema, the server alive after."""

from __future__ import annotations

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
