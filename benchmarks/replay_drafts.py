"""Drafts replayed offline: what copied drafts would accept on a server's recorded requests, before any is timed.

    python benchmarks/replay_drafts.py LOG.jsonl [LOG.jsonl ...] [--most 15] [--capacity 262144] [--skip 1]
        [--set NAME] [--out F.json]

A log is what `clover serve --record-requests FILE` wrote (or that file gzipped) (bench_agent.py records one per Clover system): each
finished sequence's prompt and answer token ids, in the order the server finished them, with the engine's
figures. The replay walks every answer as exact mode does when the model drafts nothing (on a CPU the cost model
makes no model drafts): after the prefill decides the first token, each forward verifies the drafts copied for
the context so far and commits the accepted ones plus the causal choice, i.e. `1 + accepted` tokens, where
`accepted` is how many drafts equal the recorded answer's next tokens (the answers are the model's greedy
choices, so a draft is accepted exactly when it equals them). Drafts come from

  * `context`: the request's own prompt and answer so far (clover.engine.drafts.lookup);
  * `memory`: the answers before it (clover.engine.drafts.draft_memory), shared by every request of the log, as
    `clover serve --draft-memory shared` (or per-key with one key) keeps them;
  * `both`: whichever matches deeper, as exact mode chooses;

each at most `--most` tokens, and no more than the match is deep; and, for comparison, llama.cpp's

  * `ngram-mod` (llama-server `--spec-type ngram-mod`, b11549's rules read from its `common/speculative.cpp`): a
    pool shared by every request maps each n-gram of `n_match` tokens (the build's 24) to the token that followed
    it last, filled from each prompt and, in chunks of 32 tokens, from the answer so far; a draft chains the
    pool's successors from the context's last `n_match` tokens, up to `n_max` (64), and is used only when at
    least `n_min` (48) long; the pool is emptied after five drafts in a row with under a quarter accepted. (The
    pool is a hashed table of 4M entries there; here a dict, so without its rare collisions.)

The context's drafts are also tallied by the depth of the match they continue (`context_by_depth`, the buckets of
exact mode's `CONTEXT_BUCKETS`): what exact mode's `CONTEXT_PRIOR` starts from.

Each policy verifies every draft it has (the upper bound of what the cost model would verify): the predicted
tokens per forward and the acceptance (drafts accepted / drafts compared, a rejected one included) by source,
over the requests after the first `--skip` (bench_agent's warm-up request), beside what the log's own figures
measured (forwards and drafts by source, as the engine chose them).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clover.choices import DRAFT_MEMORY_TOKENS  # noqa: E402
from clover.engine.drafts.draft_memory import DraftMemory, copied_drafts  # noqa: E402
from clover.engine.loops.exact import CONTEXT_BUCKETS, COPIED_MOST  # noqa: E402
from clover.engine.drafts.lookup import ContextLookup  # noqa: E402

POLICIES = ("context", "memory", "both")


def read_log(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every record of the logs, in order (a `.gz` log is read through gzip: how results keep them)."""
    records = []
    for path in map(Path, paths):
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        records += [json.loads(line) for line in text.splitlines() if line.strip()]
    return records


def replay(records: list[dict[str, Any]], policy: str, most: int, capacity: int, skip: int = 0) -> dict[str, Any]:
    """The predicted forwards and drafts of `policy` over `records` (module docstring); per request, its tokens
    and forwards (the first `skip` requests count in the memory, not in the figures)."""
    memory = DraftMemory(capacity) if policy != "context" else None
    tally = {"context": [0, 0], "memory": [0, 0]}  # [accepted, compared]
    by_depth = [[0, 0] for _ in range(len(CONTEXT_BUCKETS) + 1)]  # context drafts by match depth
    per_request = []
    for n, record in enumerate(records):
        prompt, answer = record["prompt"], record["answer"]
        counted = n >= skip
        index = ContextLookup(prompt + answer[:1])
        at, forwards = min(1, len(answer)), 1  # the prefill's last chunk decides the first token
        while at < len(answer):
            drafts, found, depth = copied_drafts(index, memory, most, context=policy != "memory")
            source = "memory" if found is not None else "context"
            drafts = drafts[:len(answer) - at - 1]  # none past the answer's last token
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == answer[at + accepted]:
                accepted += 1
            if drafts and counted:
                for counts in (tally[source], by_depth[sum(depth >= edge for edge in CONTEXT_BUCKETS)]
                               if found is None else [0, 0]):
                    counts[0] += accepted
                    counts[1] += min(accepted + 1, len(drafts))
            index.extend(answer[at:at + accepted + 1])
            at += accepted + 1
            forwards += 1
        if memory is not None:
            memory.add(answer)
        if counted:
            per_request.append((len(answer), forwards))
    tokens, forwards = sum(t for t, _ in per_request), sum(f for _, f in per_request)
    return {"tokens": tokens, "forwards": forwards, "tokens_per_forward": tokens / forwards if forwards else None,
            "acceptance": {s: (a / c if c else None) for s, (a, c) in tally.items()},
            "drafts": {s: {"accepted": a, "compared": c} for s, (a, c) in tally.items()},
            "context_by_depth": {f">={edge}": {"acceptance": a / c if c else None, "compared": c}
                                 for edge, (a, c) in zip((0, *CONTEXT_BUCKETS), by_depth)},
            "memory_tokens": len(memory) if memory is not None else 0}


def replay_ngram_mod(records: list[dict[str, Any]], n_match: int = 24, n_min: int = 48, n_max: int = 64,
                     skip: int = 0) -> dict[str, Any]:
    """The forwards and drafts llama-server's `ngram-mod` would make on `records` (module docstring), each draft
    verified whole: forwards, tokens per forward, the forwards that drafted, tokens drafted and accepted."""
    pool: dict[tuple[int, ...], int] = {}
    tokens = forwards = drafting = drafted = accepted_all = 0
    for n, record in enumerate(records):
        prompt, answer = record["prompt"], record["answer"]
        counted = n >= skip
        for i in range(len(prompt) - n_match):  # begin(): every n-gram of the prompt
            pool[tuple(prompt[i:i + n_match])] = prompt[i + n_match]
        added, low, at, request_forwards = max(len(prompt) - n_match, 0), 0, min(1, len(answer)), 1
        while at < len(answer):
            target = prompt + answer[:at - 1]  # what the server has decoded; answer[at - 1] is the last sampled
            if added + 32 < len(target):  # new n-grams join in chunks
                for i in range(added, len(target) - n_match):
                    pool[tuple(target[i:i + n_match])] = target[i + n_match]
                added = len(target) - n_match
            chain = (target + answer[at - 1:at])[-n_match:]
            draft: list[int] = []
            while len(chain) >= n_match and len(draft) < n_max:
                follower = pool.get(tuple(chain[len(chain) - n_match:]))
                if follower is None:
                    break
                draft.append(follower)
                chain.append(follower)
            draft = draft[:len(answer) - at] if len(draft) >= n_min else []
            accepted = 0
            while accepted < len(draft) and draft[accepted] == answer[at + accepted]:
                accepted += 1
            if draft:
                low = low + 1 if accepted < len(draft) / 4 else 0
                if low >= 5:
                    pool.clear()
                    low, added = 0, 0
                if counted:
                    drafting, drafted, accepted_all = drafting + 1, drafted + len(draft), accepted_all + accepted
            at += accepted + 1
            request_forwards += 1
        if counted:
            tokens, forwards = tokens + len(answer), forwards + request_forwards
    return {"tokens": tokens, "forwards": forwards, "tokens_per_forward": tokens / forwards if forwards else None,
            "drafting_forwards": drafting, "drafted": drafted, "accepted": accepted_all,
            "acceptance": accepted_all / drafted if drafted else None}


def measured(records: list[dict[str, Any]], skip: int = 0) -> dict[str, Any]:
    """What the server measured over the same requests: tokens per forward and acceptance by source."""
    counted = records[skip:]
    tokens = sum(len(r["answer"]) for r in counted)
    forwards = sum(r["stats"].get("forward_passes", 0) for r in counted)
    by_source: dict[str, list[int]] = {}
    for r in counted:
        for source, d in r["stats"].get("drafts", {}).items():
            entry = by_source.setdefault(source, [0, 0])
            entry[0] += d["accepted"]
            entry[1] += d["verified"]
    return {"tokens": tokens, "forwards": forwards, "tokens_per_forward": tokens / forwards if forwards else None,
            "acceptance": {s: (a / c if c else None) for s, (a, c) in by_source.items()},
            "drafts": {s: {"accepted": a, "compared": c} for s, (a, c) in by_source.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path, help="request logs (clover serve --record-requests)")
    p.add_argument("--most", type=int, default=COPIED_MOST, help="drafts copied at most (exact mode's)")
    p.add_argument("--capacity", type=int, default=DRAFT_MEMORY_TOKENS, help="the memory's capacity in tokens")
    p.add_argument("--skip", type=int, default=1, help="first requests left out of the figures (a warm-up)")
    p.add_argument("--set", default=None, help="only the records of this set (a bench_exact.py --record log's)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    records = [r for r in read_log(args.logs) if args.set is None or r.get("set") == args.set]
    if len(records) <= args.skip:
        p.error(f"the logs hold {len(records)} requests: nothing left after --skip {args.skip}")
    report = {"requests": len(records) - args.skip, "measured": measured(records, args.skip),
              **{policy: replay(records, policy, args.most, args.capacity, args.skip)
                 for policy in POLICIES},
              "ngram-mod": replay_ngram_mod(records, skip=args.skip)}
    print(f"{report['requests']} requests, {report['measured']['tokens']} answer tokens")
    for name in ("measured", *POLICIES):
        r = report[name]
        acceptance = ", ".join(f"{s} {a:.2f} ({r['drafts'][s]['accepted']}/{r['drafts'][s]['compared']})"
                               for s, a in r["acceptance"].items() if a is not None)
        if r["tokens_per_forward"] is None:  # a record without the engine's figures (bench_exact.py --record)
            continue
        print(f"{name:9} tokens per forward {r['tokens_per_forward']:.2f}  acceptance: {acceptance or 'no drafts'}")
        depths = ", ".join(f"{edge} {d['acceptance']:.2f} ({d['compared']})"
                           for edge, d in r.get("context_by_depth", {}).items() if d["acceptance"] is not None)
        if depths:
            print(f"{'':9} context drafts by match depth: {depths}")
    g = report["ngram-mod"]
    print(f"{'ngram-mod':9} tokens per forward {g['tokens_per_forward']:.2f}  drafting forwards "
          f"{g['drafting_forwards']}/{g['forwards']}, accepted {g['accepted']}/{g['drafted']} drafted")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
