"""Offline data: token shards (text, JSONL, chat), the `clover data` CLI, and BFCL conversion and matching."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from clover.chat_template import render_chat, tokenize_chat_for_training
from clover.cli.main import main
from clover.training.bfcl import (
    TRAIN_CATEGORIES,
    bfcl_to_chats,
    ensure_trainable,
    load_bfcl,
    split_of,
    tool_call_matches,
)
from clover.tokenizer import load_tokenizer
from clover.training.data import TokenShards, prepare_token_shards, resolve_tokenizer

CHAT = {"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": '{"temp_c": 21}'},
    {"role": "assistant", "content": "It is 21 °C.", "reasoning_content": "Read the tool result."},
], "tools": [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE trained in-process, saved like a checkpoint's tokenizer files."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = ["<|im_start|>assistant\n<think>\n\n</think>\n\nHello world.<|im_end|>\n",
              "def f(x):\n    return x\n"] * 20
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[MASK]"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  mask_token="[MASK]")
    directory = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerFast:
    return load_tokenizer(tokenizer_dir)


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# -- token shards -----------------------------------------------------------------------------------------------------
def test_text_shards_round_trip_across_shards(tmp_path, tokenizer_dir, tokenizer):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / ".git").mkdir()
    texts = {"a.txt": "Hello world.\n", "pkg/b.py": "def f(x):\n    return x * 2\n"}
    for name, text in texts.items():
        (src / name).write_text(text)
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")  # hidden: left out
    (src / "empty.txt").write_text("")  # no tokens: dropped
    out = tmp_path / "shards"
    meta = prepare_token_shards("text", [src], tokenizer_dir, out, shard_tokens=4, max_len=None)

    expected = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts.values()]
    shards = TokenShards(out)
    assert len(shards) == meta["num_documents"] == 2 and len(meta["shards"]) == 2
    assert shards.num_tokens == meta["num_tokens"] == meta["num_loss_tokens"] == sum(map(len, expected))
    assert meta["sources"] == [str(src / name) for name in ("a.txt", "empty.txt", "pkg/b.py")]
    assert meta["num_dropped"] == 1 and shards.mask_token_id == tokenizer.mask_token_id
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "shard-00000.safetensors", "shard-00001.safetensors"]
    with safe_open(str(out / "shard-00000.safetensors"), framework="numpy") as f:
        assert (f.get_tensor("input_ids").dtype, f.get_tensor("loss_mask").dtype,
                f.get_tensor("doc_offsets").dtype) == (np.int32, np.uint8, np.int64)
    for doc, by_index, ids in zip(shards, [shards[0], shards[-1]], expected):
        assert doc.input_ids.tolist() == by_index.input_ids.tolist() == ids
        assert doc.loss_mask.all() and doc.prompt_len == 0
    assert pickle.loads(pickle.dumps(shards))[1].input_ids.tolist() == expected[1]
    with pytest.raises(IndexError):
        shards[2]


def test_missing_sources_non_utf8_files_and_missing_tokenizer_are_errors(tmp_path, tokenizer_dir):
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        resolve_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no files match"):
        prepare_token_shards("text", [str(tmp_path / "*.md")], tokenizer_dir, tmp_path / "out")
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="blob.bin: not UTF-8"):
        prepare_token_shards("text", [str(tmp_path / "*.bin")], tokenizer_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_broken_json_line_error_names_file_and_line(tmp_path, tokenizer_dir):
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, "", '{"text": "broken'])
    with pytest.raises(ValueError, match=re.escape(f"{bad}:3: invalid JSON")):
        prepare_token_shards("jsonl", [bad], tokenizer_dir, tmp_path / "out")
    chats = _write_jsonl(tmp_path / "chats.jsonl", [CHAT, {"messages": [{"role": "narrator", "content": "x"}]}])
    with pytest.raises(ValueError, match=re.escape(f"{chats}:2: messages[0]")):
        prepare_token_shards("chat", [chats], tokenizer_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_chat_shards_train_only_assistant_answers_and_report_prompt_len(tmp_path, tokenizer_dir, tokenizer):
    no_answer = {"messages": [{"role": "user", "content": "Anyone there?"}]}
    src = _write_jsonl(tmp_path / "chats.jsonl", [CHAT, no_answer])
    meta = prepare_token_shards("chat", [src], tokenizer_dir, tmp_path / "out")
    assert (meta["num_documents"], meta["num_dropped"], meta["chat_template"]) == (1, 1, "clover")
    (doc,) = TokenShards(tmp_path / "out")
    ids, mask = tokenize_chat_for_training(tokenizer, CHAT["messages"], CHAT["tools"])
    assert doc.input_ids.tolist() == ids and doc.loss_mask.int().tolist() == mask
    prompt = render_chat(tokenizer, CHAT["messages"][:1], CHAT["tools"], add_generation_prompt=True)
    assert doc.prompt_len == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert tokenizer.decode(doc.input_ids[doc.loss_mask]).endswith("It is 21 °C.<|im_end|>")


def test_truncated_answers_are_not_trained_to_stop(tmp_path, tokenizer_dir, tokenizer):
    src = _write_jsonl(tmp_path / "chats.jsonl", [CHAT, {**CHAT, "truncated": True}])
    prepare_token_shards("chat", [src], tokenizer_dir, tmp_path / "out")
    whole, cut = TokenShards(tmp_path / "out")
    assert whole.input_ids.tolist() == cut.input_ids.tolist()
    assert tokenizer.decode(whole.input_ids[whole.loss_mask]).endswith("It is 21 °C.<|im_end|>")
    assert tokenizer.decode(cut.input_ids[cut.loss_mask]).endswith("It is 21 °C.")
    assert int(whole.loss_mask.sum()) == int(cut.loss_mask.sum()) + 1


def test_overlong_documents_are_split_or_truncated_and_counted(tmp_path, tokenizer_dir, tokenizer):
    text = "Hello world. " * 20
    src = _write_jsonl(tmp_path / "long.jsonl", [{"text": text}, {"text": "short"}])
    meta = prepare_token_shards("jsonl", [src], tokenizer_dir, tmp_path / "split", max_len=8)
    docs = list(TokenShards(tmp_path / "split"))
    full = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert all(len(d.input_ids) <= 8 for d in docs) and meta["num_split"] == 1
    assert sum((d.input_ids.tolist() for d in docs[:-1]), []) == full

    meta = prepare_token_shards("jsonl", [src], tokenizer_dir, tmp_path / "trunc", max_len=8, overlong="truncate")
    assert (meta["num_documents"], meta["num_truncated"], meta["num_truncated_tokens"]) == (2, 1, len(full) - 8)

    chats = _write_jsonl(tmp_path / "chats.jsonl", [CHAT])
    n = len(tokenize_chat_for_training(tokenizer, CHAT["messages"], CHAT["tools"])[0])
    meta = prepare_token_shards("chat", [chats], tokenizer_dir, tmp_path / "chat", max_len=n - 3)
    assert (meta["overlong"], meta["num_truncated"], meta["num_tokens"]) == ("truncate", 1, n - 3)


def test_existing_output_is_refused_and_overwrite_replaces_it(tmp_path, tokenizer_dir):
    src = _write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}])
    out = tmp_path / "out"
    prepare_token_shards("jsonl", [src], tokenizer_dir, out)
    with pytest.raises(FileExistsError, match="overwrite"):
        prepare_token_shards("jsonl", [src], tokenizer_dir, out)
    _write_jsonl(src, [{"text": "one"}, {"text": "two"}])
    prepare_token_shards("jsonl", [src], tokenizer_dir, out, overwrite=True)
    assert len(TokenShards(out)) == 2 and _leftovers(tmp_path) == []


def test_cli_writes_bfcl_chats_and_shards_them(tmp_path, tokenizer_dir, capsys):
    chats = tmp_path / "bfcl_eval.jsonl"
    assert main(["data", "bfcl", "--split", "eval", "--category", "simple_python", str(chats)]) == 0
    rows = [json.loads(line) for line in chats.read_text().splitlines()]
    assert rows and {r["category"] for r in rows} == {"simple_python"}
    out = tmp_path / "shards"
    assert main(["data", "chat", str(chats), "--tokenizer", str(tokenizer_dir), "--out", str(out),
                 "--max-len", "0"]) == 0
    assert len(TokenShards(out)) == len(rows) and "documents" in capsys.readouterr().out
    bad = _write_jsonl(tmp_path / "bad.jsonl", ["{oops"])
    assert main(["data", "jsonl", str(bad), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "x")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


# -- BFCL ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bfcl() -> dict[str, list[dict]]:
    return {split: bfcl_to_chats(split) for split in ("train", "eval", "live_simple")}


def test_bfcl_category_counts():
    counts = {c: len(load_bfcl(c)) for c in (*TRAIN_CATEGORIES, "live_simple")}
    assert counts == {"simple_python": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200,
                      "live_simple": 258}
    assert len(load_bfcl("simple")) == 400


def test_bfcl_splits_are_disjoint_deterministic_and_keep_live_data_out_of_training(bfcl):
    train, held_out = {c["id"] for c in bfcl["train"]}, {c["id"] for c in bfcl["eval"]}
    assert not train & held_out and len(train | held_out) == 1000
    assert 0.05 < len(held_out) / 1000 < 0.15
    assert held_out == {c["id"] for c in bfcl_to_chats("eval")} == {i for i in held_out if split_of(i) == "eval"}
    assert not any(c["category"].startswith("live") or c["id"].startswith("live") for c in bfcl["train"] + bfcl["eval"])
    assert len(bfcl["live_simple"]) == 258
    for category in ("live_simple", "live_multiple", "simple_java"):
        with pytest.raises(ValueError):
            ensure_trainable(category)
    with pytest.raises(ValueError, match="evaluation-only"):
        bfcl_to_chats("train", categories=["live_simple"])


def test_bfcl_chats_use_openai_tools_and_first_accepted_values(bfcl):
    def types(schema):
        if isinstance(schema, dict):
            yield from ([schema["type"]] if isinstance(schema.get("type"), str) else [])
            for value in schema.values():
                yield from types(value)
        elif isinstance(schema, list):
            for value in schema:
                yield from types(value)

    chats = {c["id"]: c for split in bfcl.values() for c in split}
    assert set(types([c["tools"] for c in chats.values()])) <= {"function", "object", "number", "integer", "string",
                                                                "boolean", "array"}
    first = chats["simple_python_0"]
    assert first["messages"][0] == {"role": "user", "content": "Find the area of a triangle with a base of 10 units "
                                                               "and height of 5 units."}
    (call,) = first["messages"][-1]["tool_calls"]
    assert call["id"] == "call_0" and call["function"]["name"] == "calculate_triangle_area"
    assert json.loads(call["function"]["arguments"]) == {"base": 10, "height": 5}  # optional "unit" left out
    (call,) = chats["simple_python_200"]["messages"][-1]["tool_calls"]  # required arg whose answers include ""
    assert json.loads(call["function"]["arguments"])["fuel_efficiency"] == 25.0


def test_tool_call_matcher_accepts_references_and_rejects_wrong_calls(bfcl):
    assert all(tool_call_matches(c["messages"][-1]["tool_calls"], c["possible_answer"])
               for c in bfcl["train"] + bfcl["eval"])
    answer = [{"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}]
    assert tool_call_matches([{"name": "calculate_triangle_area", "arguments": {"base": 10.0, "height": 5}}], answer)
    assert tool_call_matches([{"calculate_triangle_area": {"base": 10, "height": 5, "unit": "Units"}}], answer)
    for wrong in ({"base": 11, "height": 5}, {"base": 10}, {"base": 10, "height": 5, "color": "red"},
                  {"base": True, "height": 5}, {"base": "10", "height": 5}):
        assert not tool_call_matches([{"name": "calculate_triangle_area", "arguments": wrong}], answer)
    assert not tool_call_matches([{"name": "triangle_area", "arguments": {"base": 10, "height": 5}}], answer)
    assert not tool_call_matches([{"function": {"name": "calculate_triangle_area", "arguments": "{oops"}}], answer)
    parallel = [{"f": {"x": [1]}}, {"f": {"x": [2]}}, {"g": {"s": ["New York, NY"]}}]
    calls = [{"g": {"s": "new york ny"}}, {"f": {"x": 2}}, {"f": {"x": 1}}]
    assert tool_call_matches(calls, parallel)
    assert not tool_call_matches(calls[:2], parallel)
    assert not tool_call_matches([calls[0], calls[1], calls[1]], parallel)
