"""benchmarks/replay_drafts.py: the offline replay of a request log predicts forwards and acceptance as exact mode
would commit them with copied drafts, and reads what the server measured."""

from __future__ import annotations

import gzip
import json

from script_helpers import ROOT, load_script

replay_drafts = load_script(ROOT / "benchmarks" / "replay_drafts.py", "replay_drafts")


def _record(prompt, answer, forwards=None, drafts=None):
    return {"prompt": prompt, "answer": answer,
            "stats": {"forward_passes": forwards or len(answer), **({"drafts": drafts} if drafts else {})}}


def test_an_answer_given_before_is_drafted_from_memory_in_few_forwards():
    answer = [50 + i for i in range(20)]  # no repeats inside: the context alone drafts nothing
    records = [_record([1, 2, 3], answer), _record([4, 5, 6], answer)]
    context = replay_drafts.replay(records, "context", 15, 1000, skip=1)
    both = replay_drafts.replay(records, "both", 15, 1000, skip=1)
    assert context["forwards"] == 20 and context["drafts"]["context"]["compared"] == 0
    # the prefill decides 50; 51 alone (a one-token match drafts nothing); then each match drafts as many tokens as
    # it matched, all accepted: 52-53 (+54), 55-59 (+60), 61-68 (+69, the last): five forwards in all
    assert both["drafts"]["memory"]["accepted"] == both["drafts"]["memory"]["compared"] == 2 + 5 + 8
    assert both["forwards"] == 5 and both["tokens"] == 20 and both["memory_tokens"] == 40
    assert both["acceptance"]["memory"] == 1.0


def test_context_drafts_are_cut_at_a_mismatch_and_at_the_answer_end():
    # the prompt holds "7 8 9 10"; the answer repeats "7 8" then departs
    records = [_record([7, 8, 9, 10, 0], [7, 8, 9, 11, 12])]
    r = replay_drafts.replay(records, "context", 15, 1000)
    # the prefill decides 7; "0 7" occurred nowhere: 8 alone; "7 8" drafts 9 10 (0 would pass the answer's end):
    # 9 accepted, 10 rejected, so 9 and 11; then 12
    assert r["forwards"] == 4 and r["drafts"]["context"] == {"accepted": 1, "compared": 2}
    # that draft continued a two-token match: it counts in the shallowest depth bucket only
    assert r["context_by_depth"][">=0"] == {"acceptance": 0.5, "compared": 2}
    assert all(d["compared"] == 0 for edge, d in r["context_by_depth"].items() if edge != ">=0")


def test_measured_figures_are_read_from_the_log(tmp_path):
    path = tmp_path / "log.jsonl"
    records = [_record([1], [2, 3], 2), _record([1], [2, 3, 4, 5], 2, {"memory": {"accepted": 2, "verified": 3}})]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    read = replay_drafts.read_log([path])
    assert read == records
    (tmp_path / "log.jsonl.gz").write_bytes(gzip.compress(path.read_bytes()))
    assert replay_drafts.read_log([tmp_path / "log.jsonl.gz"]) == records
    m = replay_drafts.measured(read, skip=1)
    assert m["tokens_per_forward"] == 2.0 and m["acceptance"] == {"memory": 2 / 3}
    assert replay_drafts.main([str(path), "--out", str(tmp_path / "out.json")]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["requests"] == 1


def test_ngram_mod_drafts_only_a_long_chain_after_a_long_match():
    """llama-server's ngram-mod: a draft chains the pool's successors of the context's last `n_match` tokens and is
    used only when at least `n_min` long; the pool is shared by the requests."""
    text = list(range(100, 140))
    first = replay_drafts.replay_ngram_mod([_record(text, [1, 2, 3])], n_match=4, n_min=8, n_max=16)
    assert first["drafting_forwards"] == 0 and first["forwards"] == 3
    # the second prompt ends with the first's first 4 tokens: the pool continues them; the answer copies 20 of the
    # first prompt's tokens, then departs
    answer = text[4:24] + [7, 8]
    records = [_record(text, [1, 2, 3]), _record([5] + text[:4], answer)]
    second = replay_drafts.replay_ngram_mod(records, n_match=4, n_min=8, n_max=16, skip=1)
    # the prefill decides 104; a 16-token draft 105-120, all accepted, +121; a 16-token chain cut at the answer's
    # end, 122-125: 122 and 123 accepted, +7; then "121 122 123 7" continues nothing: 8 alone
    assert (second["forwards"], second["drafting_forwards"]) == (4, 2)
    assert (second["drafted"], second["accepted"]) == (20, 18)
    # with n_min above what the pool can chain, nothing is drafted
    short = replay_drafts.replay_ngram_mod(records, n_match=4, n_min=64, n_max=64, skip=1)
    assert short["drafting_forwards"] == 0 and short["forwards"] == len(answer)
