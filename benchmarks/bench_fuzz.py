"""The server fuzzed against its own OpenAPI schema: schemathesis' generated requests (valid and invalid, every route)
plus random mutations of valid bodies, on `clover serve` of a tiny random checkpoint. What must hold: no 5xx, every
response valid against the schema (status, content type, body), the server alive, and its resident memory after
the run within its start plus its configured cache budgets.

    python benchmarks/bench_fuzz.py [--examples 400] [--mutations 1500] [--seed 0] [--model DIR]

* **Generated**: for each operation of `/openapi.json`, up to `--examples` cases from schemathesis' strategies, half
  drawn as valid (`POSITIVE`) and half as invalid (`NEGATIVE`) data, each sent and checked with schemathesis'
  `not_a_server_error`, `status_code_conformance`, `content_type_conformance` and `response_schema_conformance`. A
  body's `model` string is set to the served name (else nearly every case stops at "unknown model") and its token
  limits and `n` are capped (`tame`) so a case costs milliseconds.
* **Chains** (`/v1/responses`, stateful): create, retrieve, continue (`previous_response_id`), delete, then the
  deleted id retrieved and continued (404, 400), and ids that were never made.
* **Mutations** of valid bodies of every POST route (`mutate`): broken JSON (cut, a byte changed, invalid UTF-8),
  a value of the wrong type anywhere in the body, lone UTF-16 surrogates in a string, huge numbers (2^64, 1e400,
  an integer of 5000 digits), huge strings (up to 1 MB), deep nesting, a required field removed, unknown fields;
  one to three at a time.

Writes benchmarks/results/bench_fuzz.{json,md}. The default suite runs the same code on a small budget
(tests/serving/test_fuzz_schema.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

ROOT = Path(__file__).resolve().parents[1]
KEY = "fuzz-key"
MAX_NEW = 8  # generated bodies' token limits are capped to this (`tame`)
LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass
class Tally:
    """What the fuzzing saw: statuses per route, every 5xx and every response invalid against the schema."""

    statuses: Counter = field(default_factory=Counter)
    server_errors: list[dict[str, Any]] = field(default_factory=list)
    invalid: list[dict[str, Any]] = field(default_factory=list)
    requests: int = 0

    def add(self, label: str, status: int, body: Any, text: str) -> None:
        self.requests += 1
        if self.requests % 200 == 0:
            print(f"{self.requests} requests, {len(self.server_errors)} 5xx, {len(self.invalid)} invalid", flush=True)
        self.statuses[f"{label} {status}"] += 1
        if status >= 500:
            self.server_errors.append({"route": label, "status": status, "body": _short(body), "response": text[:400]})

    def summary(self) -> dict[str, Any]:
        return {"requests": self.requests, "server_errors": len(self.server_errors), "invalid": len(self.invalid),
                "statuses": dict(sorted(self.statuses.items()))}


def _short(body: Any, limit: int = 600) -> str:
    text = body if isinstance(body, str) else (body.decode("utf-8", "replace") if isinstance(body, bytes)
                                               else json.dumps(body, default=str))
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


LIMIT_OF = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens",
            "/v1/responses": "max_output_tokens"}


def tame(body: Any, model: str, path: str) -> Any:
    """A generated body made cheap to answer: its `model` (when a string) the served one, its token limits at most
    `MAX_NEW` (set when absent: a random model writes to the end of its context), `n` at most 2. Invalid values are
    left as they are (they are what a negative case tests)."""
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = model
        if path in LIMIT_OF and not any(key in body for key in LIMITS):
            body[LIMIT_OF[path]] = MAX_NEW
        for key in LIMITS:
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > MAX_NEW:
                body[key] = MAX_NEW
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
            body["n"] = 2
    return body


def fuzz_schema(url: str, model: str, examples: int, seed: int, tally: Tally, timeout: float = 120.0,
                only: str | None = None) -> None:
    """Every operation of the served schema (or those of the path `only`), up to `examples` generated cases each
    (valid and invalid data)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)

    headers = {"Authorization": f"Bearer {KEY}"}
    spec = httpx.get(f"{url}/openapi.json", headers=headers, timeout=timeout).json()
    schema = schemathesis.openapi.from_dict(spec)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    for result in schema.get_all_operations():
        operation = result.ok()
        if only is not None and operation.path != only:
            continue
        print(f"fuzzing {operation.label}", flush=True)
        modes = schemathesis.GenerationMode

        @hypothesis_seed(seed)
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=modes.POSITIVE)
               | operation.as_strategy(generation_mode=modes.NEGATIVE))
        def check(case: Any) -> None:
            case.body = tame(case.body, model, operation.path)
            began = time.perf_counter()
            response = case.call(base_url=url, headers=headers, timeout=timeout)
            if time.perf_counter() - began > 10:
                print(f"slow ({time.perf_counter() - began:.0f} s): {_short(case.body)}", flush=True)
            tally.add(operation.label, response.status_code, case.body, response.text)
            try:
                case.validate_response(response, checks=checks, headers=headers)
            except FailureGroup as exc:  # every check that failed
                if response.status_code < 500:  # a 5xx is counted once, in `server_errors`
                    tally.invalid.append({"route": operation.label, "status": response.status_code,
                                          "body": _short(case.body), "failure": str(exc)[:600]})

        check()


def response_chains(url: str, model: str, tally: Tally, rounds: int) -> None:
    """The stateful life of stored responses: create, retrieve, continue, delete, then the deleted id again."""
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        def send(method: str, path: str, body: Any = None) -> httpx.Response:
            r = client.request(method, path, json=body)
            tally.add(f"{method} {re.sub(r'resp_[0-9a-zA-Z_-]+', '{id}', path)}", r.status_code, body, r.text)
            return r

        for i in range(rounds):
            made = send("POST", "/v1/responses", {"model": model, "input": f"Hi {i}", "max_output_tokens": MAX_NEW})
            if made.status_code != 200:
                continue
            rid = made.json()["id"]
            expect = [(send("GET", f"/v1/responses/{rid}"), 200),
                      (send("POST", "/v1/responses", {"model": model, "input": "And?", "previous_response_id": rid,
                                                      "max_output_tokens": MAX_NEW}), 200),
                      (send("DELETE", f"/v1/responses/{rid}"), 200),
                      (send("GET", f"/v1/responses/{rid}"), 404),
                      (send("DELETE", f"/v1/responses/{rid}"), 404),
                      (send("POST", "/v1/responses", {"model": model, "input": "x", "previous_response_id": rid}), 400),
                      (send("GET", f"/v1/responses/resp_never{i}"), 404)]
            for response, status in expect:
                if response.status_code != status:
                    tally.invalid.append({"route": str(response.request.url), "status": response.status_code,
                                          "body": f"chain {i}: expected {status}", "failure": response.text[:400]})


# -- mutations of valid bodies -------------------------------------------------------------------------------------
def valid_bodies(model: str) -> dict[str, list[dict[str, Any]]]:
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok"]}
    return {
        "/v1/chat/completions": [
            {"model": model, "messages": user, "max_tokens": 4},
            {"model": model, "messages": [{"role": "system", "content": "Be brief."}, *user], "max_tokens": 4,
             "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n"], "stream": True},
            {"model": model, "messages": user, "tools": tools, "tool_choice": "required", "max_tokens": 6},
            {"model": model, "messages": user, "tools": tools, "max_tokens": 6, "response_format": {
                "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
            {"model": model, "messages": user, "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
             "dry_multiplier": 0.8, "dry_sequence_breakers": ["\n", ":"], "repetition_penalty": 1.1},
        ],
        "/v1/completions": [
            {"model": model, "prompt": "Once upon a time", "max_tokens": 4},
            {"model": model, "prompt": ["a", "b"], "max_tokens": 4, "echo": True, "logprobs": 1},
        ],
        "/v1/responses": [
            {"model": model, "input": "Hi", "max_output_tokens": 4},
            {"model": model, "input": [{"role": "user", "content": "Weather?"}], "tools": [
                {"type": "function", "name": "get_weather", "parameters": tools[0]["function"]["parameters"]}],
             "max_output_tokens": 6, "stream": True},
            {"model": model, "input": "JSON", "max_output_tokens": 6, "text": {"format": {
                "type": "json_schema", "name": "a", "schema": schema}}},
        ],
    }


WRONG = [None, True, False, 0, -1, 1.5, -0.0, "", "x", [], {}, [1, "a"], {"a": 1}, 2**64, 10**30, "\ud800"]


def _paths(value: Any, at: tuple = ()) -> list[tuple]:
    """Every place in a JSON value (a key of a dict, an index of a list), depth first."""
    out = [at] if at else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*at, i))
    return out


def _set(body: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        body = body[key]
    body[path[-1]] = value


def _get(body: Any, path: tuple) -> Any:
    for key in path:
        body = body[key]
    return body


def _strings(body: Any) -> list[tuple]:
    return [p for p in _paths(body) if isinstance(_get(body, p), str)]


def mutate(body: dict[str, Any], rng: random.Random, longest: int = 1_000_000) -> bytes:
    """One to three random mutations of `body` (a valid request), serialised (`ensure_ascii`: a lone surrogate goes
    out as its `\\ud800` escape, as a client's JSON library writes it). A token limit dropped or set to null is put
    back (`MAX_NEW`): without one a random model writes to the end of its context, a minute a request."""
    body = copy.deepcopy(body)
    limit = next((key for key in LIMITS if key in body), None)
    raw_edits: list[Callable[[bytes], bytes]] = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["wrong_type", "wrong_type", "surrogate", "huge_number", "huge_string", "deep", "drop",
                           "unknown", "broken_json"])
        paths = _paths(body)
        if kind == "wrong_type" and paths:
            _set(body, rng.choice(paths), rng.choice(WRONG))
        elif kind == "surrogate" and _strings(body):
            path = rng.choice(_strings(body))
            text = _get(body, path)
            cut = rng.randint(0, len(text))
            _set(body, path, text[:cut] + rng.choice(["\ud800", "\udfff", "\udbff"]) + text[cut:])
        elif kind == "huge_number" and paths:
            _set(body, rng.choice(paths), rng.choice([2**64, -(2**63) - 1, 1e308, -1e308, float("inf"),
                                                      float("nan"), "HUGE_INT"]))
        elif kind == "huge_string" and paths:
            _set(body, rng.choice(paths), rng.choice("ab<|\n{") * rng.choice([n for n in (10_000, 100_000, 1_000_000)
                                                                             if n <= longest]))
        elif kind == "deep" and paths:
            depth = rng.choice([64, 200, 5000])
            _set(body, rng.choice(paths), "DEEP" + str(depth))
        elif kind == "drop" and paths:
            path = rng.choice(paths)
            parent = _get(body, path[:-1])
            parent.pop(path[-1])
        elif kind == "unknown":
            body[rng.choice(["extra", "logit_bias", "user", "metadata", "chat_template_kwargs"])] = rng.choice(WRONG)
        elif kind == "broken_json":
            raw_edits.append(lambda raw: _break(raw, rng))
    if limit is not None and body.get(limit) is None:
        body[limit] = MAX_NEW
    raw = json.dumps(body, ensure_ascii=True, allow_nan=True).encode()
    raw = raw.replace(b'"HUGE_INT"', b"1" + b"0" * 5000)
    raw = re.sub(rb'"DEEP(\d+)"', lambda m: b"[" * int(m[1]) + b"1" + b"]" * int(m[1]), raw)
    raw = raw.replace(b"Infinity", b"1e400") if rng.random() < 0.5 else raw
    for edit in raw_edits:
        raw = edit(raw)
    return raw


def _break(raw: bytes, rng: random.Random) -> bytes:
    at = rng.randrange(len(raw)) if raw else 0
    return rng.choice([raw[:at], raw[:at] + bytes([rng.randrange(256)]) + raw[at + 1:], raw[:at] + b"\xff\xfe"
                       + raw[at:], raw + b"}", b"{" + raw, raw.replace(b":", b"=", 1)])


def fuzz_mutations(url: str, model: str, count: int, seed: int, tally: Tally, longest: int = 1_000_000,
                   timeout: float = 60.0) -> None:
    """`count` mutated valid bodies (strings up to `longest` characters); a request unanswered after `timeout` s is
    a finding (kept with the 5xx), not the end of the run."""
    rng = random.Random(seed)
    bodies = [(route, body) for route, some in valid_bodies(model).items() for body in some]
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=timeout) as client:
        for _ in range(count):
            route, body = rng.choice(bodies)
            raw = mutate(body, rng, longest)
            try:
                r = client.post(route, content=raw)
            except httpx.TimeoutException:
                tally.add(f"POST {route} (mutated)", 0, raw, f"no answer after {timeout} s")
                tally.server_errors.append({"route": route, "status": "timeout", "body": _short(raw, 2000),
                                            "response": f"no answer after {timeout} s"})
                continue
            tally.add(f"POST {route} (mutated)", r.status_code, raw, r.text)
            error = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") \
                and r.status_code >= 400 else None
            if r.status_code >= 400 and (not isinstance(error, dict) or not error.get("code")):
                tally.invalid.append({"route": route, "status": r.status_code, "body": _short(raw),
                                      "failure": "an error without OpenAI's {error: {code}}: " + r.text[:300]})


# -- the run ---------------------------------------------------------------------------------------------------------
def resident_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)[1]) / 1024


def warm_up(url: str, model: str) -> None:
    """One request of each kind, so what is built on first use (a grammar's tokenizer, decision mode, the engines of
    each rule) is in the resident memory the run starts from."""
    headers = {"Authorization": f"Bearer {KEY}"}
    for route, bodies in valid_bodies(model).items():
        for body in bodies:
            r = httpx.post(f"{url}{route}", json=body, headers=headers, timeout=300)
            if r.status_code != 200:
                raise RuntimeError(f"warm-up {route} {body}: {r.status_code} {r.text}")


def run(url: str, pid: int, model: str, budgets_mib: float, examples: int, mutations: int, chains: int,
        seed: int) -> dict[str, Any]:
    """Warm up, fuzz, and report: the tally, the resident memory before and after, whether the server is alive."""
    warm_up(url, model)
    print("warmed up", flush=True)
    start_mib = resident_mib(pid)
    tally, began = Tally(), time.perf_counter()
    fuzz_schema(url, model, examples, seed, tally)
    response_chains(url, model, tally, chains)
    fuzz_mutations(url, model, mutations, seed, tally)
    alive = httpx.get(f"{url}/health", timeout=30).status_code == 200
    end_mib = resident_mib(pid)
    return {**tally.summary(), "seconds": time.perf_counter() - began, "alive": alive, "rss_start_mib": start_mib,
            "rss_end_mib": end_mib, "budgets_mib": budgets_mib, "within_budget": end_mib <= start_mib + budgets_mib,
            "server_error_cases": tally.server_errors[:50], "invalid_cases": tally.invalid[:50]}


def serve_args(model_dir: Path, port: int, name: str, budgets: dict[str, float]) -> list[str]:
    return [sys.executable, "-m", "clover.cli.main", "serve", "--model", str(model_dir), "--port", str(port),
            "--served-model-name", name, "--api-key", KEY, "--log-level", "error", "--threads", "1",
            "--max-model-len", str(CONTEXT),
            "--prefix-cache-mb", str(budgets["prefix_cache_mb"]),
            "--responses-store-mb", str(budgets["responses_store_mb"])]


BUDGETS = {"prefix_cache_mb": 32.0, "responses_store_mb": 8.0}
CONTEXT = 512  # the served context: what bounds a body whose token limit a mutation renamed (`mutate`)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=400, help="generated cases per operation, at most")
    p.add_argument("--mutations", type=int, default=1500)
    p.add_argument("--chains", type=int, default=30, help="stored-response chains")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, default=None, help="a checkpoint (default: a random clover-tiny-dense)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_fuzz")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_server import build_checkpoint, machine, write_results
    from server_process import ServerProcess

    where = machine()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_checkpoint("clover-tiny-dense", Path(tmp), vocab_size=49152)
        log = Path(tmp) / "server.log"
        with ServerProcess("clover serve", lambda port: serve_args(model_dir, port, "fuzz", BUDGETS), log,
                           threads=1) as server:
            out = run(server.url, server.proc.pid, "fuzz", sum(BUDGETS.values()), args.examples, args.mutations,
                      args.chains, args.seed)
    lines = [f"# bench_fuzz ({where}; seed {args.seed}, {args.examples} generated cases per operation at most, "
             f"{args.mutations} mutations, {args.chains} response chains)", "",
             f"- requests: {out['requests']} in {out['seconds']:.0f} s; 5xx: {out['server_errors']}; responses "
             f"invalid against the schema: {out['invalid']}; alive after: {out['alive']}",
             f"- resident memory: {out['rss_start_mib']:.0f} MiB after warm-up, {out['rss_end_mib']:.0f} MiB after "
             f"the run (budgets {out['budgets_mib']:.0f} MiB: within {out['within_budget']})", "",
             "| route and status | responses |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in out["statuses"].items()]
    for case in out["server_error_cases"][:10] + out["invalid_cases"][:10]:
        lines += ["", f"- {case['route']} {case['status']}: `{case['body'][:300]}` -> {case.get('response', '')}"
                      f"{case.get('failure', '')}"]
    print("\n".join(lines))
    write_results(args.out, {"machine": where, "seed": args.seed, "examples": args.examples,
                             "mutations": args.mutations, "budgets": BUDGETS, **out}, lines)


if __name__ == "__main__":
    main()
