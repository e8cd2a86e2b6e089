"""clover-smol's distillation data (recipes/clover_smol): prompt set, held-out split, BFCL train mix, resumability."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
from script_helpers import ROOT, load_script

RECIPE = ROOT / "recipes" / "clover_smol"
prompts = load_script(RECIPE / "prompts.py", "clover_smol_prompts")
distill = load_script(RECIPE / "distill.py", "clover_smol_distill")


@pytest.fixture(scope="module")
def split():
    return prompts.build_prompts(seed=0)


def test_prompt_set_is_deterministic(split):
    train, heldout = split
    again_train, again_heldout = prompts.build_prompts(seed=0)
    assert [p.row() for p in train] == [p.row() for p in again_train]
    assert [p.row() for p in heldout] == [p.row() for p in again_heldout]
    other_train, _ = prompts.build_prompts(seed=1)
    assert {p.id for p in other_train} != {p.id for p in train}


def test_counts_per_category(split):
    train, heldout = split
    assert Counter(p.category for p in train) == prompts.TRAIN_COUNTS
    assert Counter(p.category for p in heldout) == prompts.HELDOUT_COUNTS
    assert sum(prompts.TRAIN_COUNTS.values()) == 3000 and len(heldout) == 150
    templates = Counter(p.template for p in train)
    assert len(templates) >= 50  # diverse: no category is one template
    code = Counter(p.template for p in train if p.category == "code")
    assert {"code.explain_stdlib", "code.complete_stdlib", "code.fix_bug", "code.unit_test",
            "code.write_function"} <= set(code)


def test_no_duplicates(split):
    train, heldout = split
    everything = train + heldout
    assert len({p.id for p in everything}) == len(everything)
    assert len({prompts._normalize(p.text) for p in everything}) == len(everything)


def test_heldout_disjoint_from_train_by_template_instance_and_subject(split):
    train, heldout = split
    train_subjects = {p.subject for p in train}
    assert not {p.subject for p in heldout} & train_subjects
    assert not {(p.template, p.subject) for p in heldout} & {(p.template, p.subject) for p in train}


def test_rows_are_single_user_turns(split, tmp_path: Path):
    assert prompts.main(["--out", str(tmp_path)]) == 0
    train, heldout = split
    for name, expected in (("train.jsonl", train), ("heldout.jsonl", heldout)):
        rows = [json.loads(line) for line in (tmp_path / name).read_text(encoding="utf-8").splitlines()]
        assert rows == [p.row() for p in expected]
        for row in rows:
            assert set(row) == {"id", "category", "messages"}
            assert row["category"] in prompts.CATEGORIES and row["id"].startswith(row["category"] + ".")
            (message,) = row["messages"]
            assert message["role"] == "user" and message["content"].strip()


def test_larger_train_set_extends_the_default_one(split):
    train, heldout = split
    bigger, same_heldout = prompts.build_prompts(seed=0, train_counts={c: 2 * n for c, n in
                                                                       prompts.TRAIN_COUNTS.items()})
    assert {p.id for p in train} <= {p.id for p in bigger}  # answers already distilled stay valid
    assert [p.id for p in same_heldout] == [p.id for p in heldout]


def test_bfcl_train_mix_has_no_eval_or_live_examples():
    if importlib.util.find_spec("bfcl_eval") is None:
        pytest.skip("bfcl-eval is not installed")
    from clover.training.bfcl import TRAIN_CATEGORIES, split_of

    chats = distill.bfcl_train_chats()
    ids = [c["id"] for c in chats]
    assert chats and len(set(ids)) == len(ids)
    assert all(split_of(i) == "train" and not i.startswith("live") for i in ids)
    assert {c["category"] for c in chats} <= set(TRAIN_CATEGORIES)
    assert all(c["messages"][-1]["role"] == "assistant" and c["messages"][-1]["tool_calls"] for c in chats)


# -- distill.py helpers (no model needed) ----------------------------------------------------------------------------
def test_resume_skips_answered_ids_and_drops_a_torn_line(tmp_path: Path):
    out = tmp_path / "answers.jsonl"
    out.write_text(json.dumps({"id": "a", "messages": []}) + "\n" + '{"id": "b", "mess', encoding="utf-8")
    assert distill.answered_ids(out) == {"a"}
    assert out.read_text(encoding="utf-8").endswith("\n")  # the torn line is gone; appends start clean
    assert distill.answered_ids(tmp_path / "missing.jsonl") == set()


def test_batches_cover_every_prompt_once():
    rows = list(range(37))
    lengths = [(i * 7) % 11 for i in rows]
    seen = [i for batch in distill.batches(rows, lengths, 4) for i in batch]
    assert sorted(seen) == rows
    assert all(len(b) <= 4 for b in distill.batches(rows, lengths, 4))


def test_repetition_flags_loops_not_ordinary_text():
    loop = [5, 6, 7, 8, 9, 10, 11] * 30
    plain = list(range(200))
    assert distill.repetition(loop) >= distill.LOOP_THRESHOLD
    assert distill.repetition(plain) == 0.0
    assert distill.repetition([1, 2]) == 0.0


def test_export_drops_loops_and_optionally_truncated(tmp_path: Path):
    answers = tmp_path / "answers.jsonl"
    rows = [{"id": "ok", "loop": False, "truncated": False}, {"id": "loop", "loop": True, "truncated": True},
            {"id": "cut", "loop": False, "truncated": True}]
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "train_chats.jsonl"
    assert distill.export_for_training(answers, out) == {"kept": 2, "dropped_loop": 1, "dropped_truncated": 0}
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["ok", "cut"]
    counts = distill.export_for_training(answers, out, drop_truncated=True)
    assert counts == {"kept": 1, "dropped_loop": 1, "dropped_truncated": 1}


def test_distillation_prompt_is_rendered_exactly_as_training_renders_it():
    """The base answers in the very context the adapted model is trained (and served) in: the prompt's ids are
    the training document's ids before its first supervised token."""
    from test_chat_template import build_tiny_tokenizer

    from clover.chat_template import tokenize_chat_for_training

    tokenizer = build_tiny_tokenizer()
    user = [{"role": "user", "content": "Write a haiku about the weather."}]
    prompt = distill.render_prompt(tokenizer, user)
    ids, mask = tokenize_chat_for_training(tokenizer, [*user, {"role": "assistant", "content": "Sunny skies."}])
    assert prompt == ids[: mask.index(1)]
    assert "You are a helpful AI assistant" not in tokenizer.decode(prompt)  # no base-template system prompt


def test_answers_pack_to_token_ids_and_unpack_to_the_same_answers(chat_tokenizer, tmp_path: Path):
    """The committed form of the distilled answers: token ids (a row written before the ids were kept is
    re-encoded), unpacked to the same text, marks and order; a torn last line (a running distillation) waits."""
    prompts = [{"id": f"chat.x.{i}", "category": "chat", "messages": [{"role": "user", "content": f"hi {i}"}]}
               for i in range(3)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    texts = ["Hello world. The weather is sunny.", "def add(x, y):\n    return x + y\n", "It is 21 degrees."]
    rows = [distill._answer_row(p, chat_tokenizer(t, add_special_tokens=False)["input_ids"], chat_tokenizer,
                                i == 1, 0.1 * i, False) for i, (p, t) in enumerate(zip(prompts, texts))]
    del rows[2]["token_ids"]  # as the first rows of a run that started before the ids were kept
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"id": "torn')
    figures = distill.pack(answers, tmp_path / "packed.safetensors", chat_tokenizer, cpu_hours=0.5)
    assert figures["answers"] == 3 and figures["cpu_hours"] == 0.5
    out = tmp_path / "restored.jsonl"
    assert distill.unpack(tmp_path / "packed.safetensors", tmp_path / "prompts.jsonl", out, chat_tokenizer) == 3
    restored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"] for r in restored] == [r["messages"] for r in rows]
    assert [(r["id"], r["truncated"], r["repetition"], r["loop"]) for r in restored] == \
        [(r["id"], r["truncated"], r["repetition"], r["loop"]) for r in rows]
    assert distill.unpack(tmp_path / "packed.safetensors", tmp_path / "prompts.jsonl", out, chat_tokenizer) == 0
