"""benchmarks/bench_exact.py's figures from the systems' decodes (fake systems: no model runs)."""

from __future__ import annotations

from script_helpers import ROOT, load_script

bench = load_script(ROOT / "benchmarks" / "bench_exact.py", "bench_exact")


def fake(tokens: list[int], stats: dict) -> object:
    return lambda ids, max_new: (tokens[:max_new], {"time_to_first_token_s": 0.0, **stats})


def test_a_servers_drafts_give_its_tokens_per_forward_and_acceptance():
    """llama-server-ngram answering as `llama_server.completion_result` reads a response with drafts: its TPF is
    tokens over forwards, its acceptance the accepted share of what it drafted, its answer compared with int4-b1's."""
    answer = [5, 6, 7, 8, 9, 10]
    loaded = {"int4-b1": (fake(answer, {"forward_passes": 6}), None),
              "llama-server-ngram": (fake(answer, {"forward_passes": 3, "draft_tokens": 4,
                                                   "draft_tokens_accepted": 3}), None)}
    report = bench.compare(loaded, {"code": [[1, 2, 3], [4, 5]]}, max_new=6)
    ngram, b1 = report["code"]["llama-server-ngram"], report["code"]["int4-b1"]
    assert ngram["tokens_per_forward"] == 2.0 and ngram["draft_acceptance"] == 0.75
    assert ngram["same_as_int4-b1"] == 2 and "draft_acceptance" not in b1


def test_the_llama_server_systems_are_compared_with_block_size_one():
    assert set(bench.SERVERS) <= set(bench.SYSTEMS)
    assert all(bench.REFERENCE[name] == "int4-b1" for name in bench.SERVERS)


def test_the_runners_exact_mode_is_compared_with_its_own_block_size_one_and_where_it_parts():
    """clover-llamacpp-<q> is held to llamacpp-b1-<q> (same file, same runner): identical answers counted, and each
    prompt's first differing token recorded (None where equal; an answer cut short parts where it ends)."""
    assert all(bench.REFERENCE[f"clover-llamacpp-{q}"] == f"llamacpp-b1-{q}" for q in bench.RUNNER_QUANTS)
    prompts = {"code": [[1], [2], [3]]}
    answers = {"clover-llamacpp-q4_0": {1: [5, 6, 7], 2: [5, 9, 7], 3: [5, 6]},
               "llamacpp-b1-q4_0": {1: [5, 6, 7], 2: [5, 6, 7], 3: [5, 6, 7]}}

    def system(name: str) -> object:
        return lambda ids, max_new: (answers[name].get(ids[0], []), {"forward_passes": 1, "time_to_first_token_s": 0.0})

    loaded = {name: (system(name), None) for name in answers}
    figures = bench.compare(loaded, prompts, max_new=3)["code"]["clover-llamacpp-q4_0"]
    assert figures["same_as_llamacpp-b1-q4_0"] == 1
    assert figures["first_divergence"] == [None, 1, 2]
