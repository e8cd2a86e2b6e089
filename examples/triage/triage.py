"""Worked example: support-ticket triage as one decision — decision decoding against AR constrained decoding.

    python examples/triage/triage.py                 # tokenizer + data + training (config.yaml) + comparison
    python examples/triage/triage.py --eval-only     # compare with the latest checkpoint of the run
    python examples/triage/triage.py --threads 1     # any TrainConfig key overrides config.yaml

Task: a ticket (a few generated sentences) and the form `FORM` (category, urgency, team, needs_human). The
judgments are tied by rules (`violations`): the team follows from the category, an outage is critical, a
feature request is low, and a human is needed exactly when the urgency is high or critical. Some tickets state
their urgency only through those rules (an outage or a feature request without an urgency cue).

The model is the `clover-tiny-dense` preset (2 attention layers) with a wider hidden size and a byte-level BPE
trained on the generated text, trained from scratch with the project's trainer on the block-diffusion objective
(one 32-token block holds the whole answer) plus the causal AR term, so the same weights decode both ways. The comparison decodes the
held-out tickets one at a time with `clover.engine.loops.decision.decide` (threshold 0.9 and 1.0) and with
`decide_autoregressive` (block size 1, field by field), and prints per-field and whole-form accuracy, forms that
break a rule, forward passes and latency as a markdown table (also written to `runs/triage/table.md`). A run
stopped early resumes when started again; each stage is skipped when its output exists.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
FORM = {
    "type": "object",
    "properties": {
        "category": {"enum": ["billing", "bug", "account", "outage", "feature"]},
        "urgency": {"enum": ["low", "medium", "high", "critical"]},
        "team": {"enum": ["payments", "engineering", "support", "sre", "product"]},
        "needs_human": {"type": "boolean"},
    },
    "required": ["category", "urgency", "team", "needs_human"],
    "additionalProperties": False,
}
TEAM = {"billing": "payments", "bug": "engineering", "account": "support", "outage": "sre", "feature": "product"}
ISSUES = {
    "billing": ["I was charged twice for my {plan} plan.", "My invoice for {month} shows the wrong amount.",
                "Please refund the payment I made on {month} 3.", "The card on file was declined but money left."],
    "bug": ["The {page} page shows an error when I click save.", "Exporting a report crashes the app.",
            "The {page} button does nothing in {browser}.", "Search returns results from other projects."],
    "account": ["I cannot reset my password.", "My two-factor codes stopped working.",
                "Please change the email on my account.", "I am locked out after too many login attempts."],
    "outage": ["The whole site is down for our team.", "Every request returns a 500 error since {time}.",
               "Nobody in the company can reach the dashboard.", "The API has been unreachable since {time}."],
    "feature": ["It would be great to have a dark mode.", "Please add an export to {fmt}.",
                "Could you support single sign-on with {idp}?", "A bulk edit option would help us a lot."],
}
URGENCY_CUES = {
    "low": ["No rush, whenever you can.", "This is minor.", "Just a suggestion for later."],
    "medium": ["It would be good to fix this this week.", "It is annoying but we can work around it."],
    "high": ["This blocks our work today.", "Please look at this as soon as possible."],
    "critical": ["We are losing money every minute.", "This is an emergency for us."],
}
FILLER = ["Thanks for your help.", "I am using the {plan} plan.", "We have been customers for {n} years.",
          "My colleague saw the same thing.", "I tried again in {browser}.", "Best regards."]
SLOTS = {"plan": ["basic", "team", "enterprise"], "month": ["March", "June", "October"],
         "page": ["settings", "billing", "profile"], "browser": ["Firefox", "Chrome", "Safari"],
         "time": ["9am", "noon", "last night"], "fmt": ["CSV", "PDF", "Excel"], "idp": ["Okta", "Azure AD"],
         "n": ["two", "five", "ten"]}


def violations(values: dict[str, Any]) -> list[str]:
    """The task's rules a filled form breaks (empty: consistent)."""
    broken = []
    if values["team"] != TEAM[values["category"]]:
        broken.append("team")
    if values["category"] == "outage" and values["urgency"] != "critical":
        broken.append("outage_critical")
    if values["category"] == "feature" and values["urgency"] != "low":
        broken.append("feature_low")
    if values["needs_human"] != (values["urgency"] in ("high", "critical")):
        broken.append("needs_human")
    return broken


def make_ticket(rng: random.Random) -> tuple[str, dict[str, Any]]:
    category = rng.choice(list(ISSUES))
    fixed = {"outage": "critical", "feature": "low"}.get(category)
    urgency = fixed or rng.choice(["low", "medium", "high"])
    sentences = [rng.choice(ISSUES[category])]
    if fixed is None or rng.random() < 0.3:  # outages and feature requests often leave it to the rules
        sentences.append(rng.choice(URGENCY_CUES[urgency]))
    sentences += rng.sample(FILLER, rng.randint(0, 2))
    rng.shuffle(sentences)
    text = " ".join(s.format(**{k: rng.choice(v) for k, v in SLOTS.items()}) for s in sentences)
    values = {"category": category, "urgency": urgency, "team": TEAM[category],
              "needs_human": urgency in ("high", "critical")}
    return text, values


def build_tokenizer(texts: list[str], out: Path) -> Any:
    """A byte-level BPE trained on the tickets and their answers, with EOS and a mask token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1024, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|mask|>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", mask_token="<|mask|>")
    tok.save_pretrained(out)
    return tok


def write_data(root: Path, n_train: int, n_eval: int, seed: int) -> Any:
    """Tickets (held-out ones never in training), the tokenizer, and token shards whose response is the answer
    block exactly as decision decoding lays it out (`Layout.fill`)."""
    from clover import CloverConfig
    from clover.engine.loops.decision import render_layout, render_prompt
    from clover.engine.constraints.form import parse_form
    from clover.training.data import write_token_shards

    rng = random.Random(seed)
    splits: dict[str, list[tuple[str, dict[str, Any]]]] = {"eval": [], "train": []}
    seen: set[str] = set()
    for name, count in (("eval", n_eval), ("train", n_train)):
        while len(splits[name]) < count:
            text, values = make_ticket(rng)
            if name == "train" and text in seen:
                continue
            seen.add(text)
            splits[name].append((text, values))
    form = parse_form(FORM)
    tok = build_tokenizer([t for t, _ in splits["train"]] + [json.dumps(v) for _, v in splits["train"][:2000]],
                          root / "tokenizer")
    config = CloverConfig.from_preset("clover-tiny", vocab_size=len(tok), mask_token_id=tok.mask_token_id,
                                      eos_token_id=tok.eos_token_id, block_size=32)
    layout = render_layout(form, tok, config)
    if len(layout.ids) > config.block_size:
        raise ValueError(f"the answer takes {len(layout.ids)} tokens, more than the block of {config.block_size}")
    tokenize = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    for name, rows in splits.items():
        docs = []
        for text, values in rows:
            prompt = render_prompt(tok, text, form)
            answer = layout.fill(values, tokenize)[:layout.answer_len]  # without the block's mask padding
            docs.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
        write_token_shards(docs, root / "data" / name, max_len=None, overwrite=True,
                           meta={"task": "triage", "eos_token_id": tok.eos_token_id})
        (root / "data" / f"{name}.jsonl").write_text("".join(json.dumps({"text": t, "values": v}) + "\n"
                                                             for t, v in rows))
    return tok


def compare(checkpoint: Path, root: Path, n: int) -> dict[str, dict[str, float]]:
    from clover import CloverForBlockDiffusion
    from clover.engine.loops.decision import decide, decide_autoregressive
    from clover.tokenizer import load_tokenizer

    model = CloverForBlockDiffusion.from_pretrained(checkpoint).eval()
    tok = load_tokenizer(root / "tokenizer")
    rows = [json.loads(line) for line in (root / "data" / "eval.jsonl").read_text().splitlines()][:n]
    methods = {"AR constrained (block size 1)": lambda text: decide_autoregressive(model, tok, text, FORM),
               "decision, threshold 1.0": lambda text: decide(model, tok, text, FORM, threshold=1.0),
               "decision, threshold 0.9": lambda text: decide(model, tok, text, FORM, threshold=0.9)}
    for run in methods.values():  # warm-up (first-call allocations, the tokenizer's token classes)
        run(rows[0]["text"])
    results = {}
    for name, run in methods.items():
        correct = {f: 0 for f in FORM["properties"]}
        whole = broken = forwards = 0
        wall = 0.0
        for row in rows:
            start = time.perf_counter()
            d = run(row["text"])
            wall += time.perf_counter() - start
            for f in correct:
                correct[f] += d.values[f] == row["values"][f]
            whole += d.values == row["values"]
            broken += bool(violations(d.values))
            forwards += d.forward_passes
        results[name] = {**{f: c / len(rows) for f, c in correct.items()}, "form": whole / len(rows),
                         "broken": broken / len(rows), "forward_passes": forwards / len(rows),
                         "latency_ms": 1000 * wall / len(rows)}
    return results


def table(results: dict[str, dict[str, float]]) -> str:
    fields = list(FORM["properties"])
    lines = ["| method | " + " | ".join(fields) + " | whole form | forms breaking a rule | forward passes | latency |",
             "|---|" + "---|" * (len(fields) + 4)]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{100 * r[f]:.1f} %" for f in fields)
                     + f" | {100 * r['form']:.1f} % | {100 * r['broken']:.1f} % | {r['forward_passes']:.2f} | "
                       f"{r['latency_ms']:.1f} ms |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=HERE / "config.yaml")
    parser.add_argument("--eval-only", action="store_true", help="skip training; compare with the latest checkpoint")
    parser.add_argument("--eval-tickets", type=int, default=500, help="held-out tickets decoded (default 500)")
    parser.add_argument("--train-tickets", type=int, default=30_000)
    args, overrides = parser.parse_known_args(argv)

    from clover.training import load_train_config, train
    from clover.training.checkpointing import latest_checkpoint

    config = load_train_config(args.config, overrides)
    root = Path(config.output_dir)  # the example's tokenizer and data live under the run's output_dir
    config.train_data, config.eval_data = str(root / "data" / "train"), str(root / "data" / "eval")
    config.tokenizer = str(root / "tokenizer")
    if config.threads:
        torch.set_num_threads(config.threads)
    if not (root / "data" / "train" / "meta.json").is_file():
        write_data(root, args.train_tickets, 1000, seed=1234)
    if not config.model_overrides.get("vocab_size"):
        from clover.tokenizer import load_tokenizer

        tok = load_tokenizer(root / "tokenizer")
        config.model_overrides.update(vocab_size=len(tok), mask_token_id=tok.mask_token_id,
                                      eos_token_id=tok.eos_token_id, block_size=config.block_size)
    if not args.eval_only:
        start = time.perf_counter()
        result = train(config)
        print(f"trained {result.step} steps in {(time.perf_counter() - start) / 60:.1f} min; last loss "
              f"{result.losses[-1]:.4f}" if result.losses else f"nothing to train (at step {result.step})")
    checkpoint = latest_checkpoint(config.output_dir)
    if checkpoint is None:
        print("no checkpoint to compare", file=sys.stderr)
        return 1
    results = compare(checkpoint, root, args.eval_tickets)
    text = table(results)
    machine = f"{platform.machine()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}"
    print(f"{checkpoint}, {args.eval_tickets} held-out tickets, {machine}\n\n{text}")
    (root / "table.md").write_text(text + "\n")
    (root / "triage_eval.json").write_text(json.dumps({"checkpoint": str(checkpoint), "machine": machine,
                                                       "tickets": args.eval_tickets, **results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
