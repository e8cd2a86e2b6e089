"""benchmarks/llama_server.py: llama.cpp's server options as xllamacpp's CommonParams (no model loaded), the command
the benchmarks start it with, and bench_exact.py's reading of a `/completion` response."""

from __future__ import annotations

import pytest

from script_helpers import ROOT, load_script

llama_server = load_script(ROOT / "benchmarks" / "llama_server.py", "llama_server")


def params(*options: str):
    xllamacpp = pytest.importorskip("xllamacpp")
    return llama_server.server_params(llama_server.parse_args(["model.gguf", "--port", "8080", *options]), xllamacpp)


def test_ngram_mod_and_cache_reuse_reach_llama_cpp():
    p = params("--spec-type", "ngram-mod", "--spec-ngram-mod-n-min", "4", "--spec-ngram-mod-n-max", "16",
               "--cache-reuse", "256")
    assert [t.name for t in p.speculative.types] == ["COMMON_SPECULATIVE_TYPE_NGRAM_MOD"]
    mod = p.speculative.ngram_mod
    assert (mod.n_match, mod.n_min, mod.n_max) == (24, 4, 16)
    assert p.n_cache_reuse == 256 and p.n_parallel == 1 and p.cache_prompt


def test_plain_server_has_no_speculation_and_no_reuse():
    p = params()
    assert [t.name for t in p.speculative.types] == ["COMMON_SPECULATIVE_TYPE_NONE"] and p.n_cache_reuse == 0


def test_map_options_set_the_chosen_map_type_only():
    p = params("--spec-type", "ngram-map-k4v", "--spec-ngram-size-n", "8", "--spec-ngram-min-hits", "2")
    assert (p.speculative.ngram_map_k4v.size_n, p.speculative.ngram_map_k4v.min_hits) == (8, 2)
    assert p.speculative.ngram_simple.size_n == p.speculative.ngram_map_k.size_n == 12  # the build's default


def test_an_option_of_another_spec_type_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        llama_server.parse_args(["m.gguf", "--port", "1", "--spec-type", "ngram-simple", "--spec-ngram-mod-n-max", "8"])
    assert "--spec-ngram-mod-n-max applies to --spec-type ngram-mod, not ngram-simple" in capsys.readouterr().err


def test_every_offered_spec_type_is_one_of_the_builds():
    xllamacpp = pytest.importorskip("xllamacpp")
    members = xllamacpp.common_speculative_type.__members__
    for name in llama_server.SPEC_TYPES:
        assert "COMMON_SPECULATIVE_TYPE_" + name.upper().replace("-", "_") in members


def test_the_command_parses_back_to_its_options():
    argv = llama_server.command("/m.gguf", 9000, alias="bench", ctx=4096, threads=2, spec_type="ngram-mod",
                                cache_reuse=64)
    assert argv[1].endswith("benchmarks/llama_server.py")
    args = llama_server.parse_args(argv[2:])
    assert (args.gguf, args.port, args.alias, args.ctx, args.threads, args.spec_type, args.cache_reuse) == (
        "/m.gguf", 9000, "bench", 4096, 2, "ngram-mod", 64)


def test_the_build_is_read_from_the_xllamacpp_version(monkeypatch):
    monkeypatch.setattr(llama_server.importlib.metadata, "version", lambda name: "2026.10.11549")
    assert llama_server.llama_cpp_build() == {"xllamacpp": "2026.10.11549", "llama_cpp": "b11549"}


def test_a_completion_with_accepted_drafts_counts_fewer_forwards_and_drops_the_end_token():
    response = {"tokens": [5, 6, 7, 8, 9, 2], "stop_type": "eos",
                "timings": {"prompt_ms": 250.0, "draft_n": 6, "draft_n_accepted": 3}}
    tokens, stats = llama_server.completion_result(response)
    assert tokens == [5, 6, 7, 8, 9]
    assert stats == {"forward_passes": 3, "time_to_first_token_s": 0.25, "draft_tokens": 6, "draft_tokens_accepted": 3}


def test_a_completion_without_drafts_is_one_forward_a_token():
    response = {"tokens": [5, 6, 7], "stop_type": "limit", "timings": {"prompt_ms": 10.0}}
    tokens, stats = llama_server.completion_result(response)
    assert tokens == [5, 6, 7] and stats["forward_passes"] == 3 and stats["draft_tokens_accepted"] == 0
