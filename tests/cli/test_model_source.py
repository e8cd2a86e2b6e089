"""`--model` as users type it: a hub id resolved through huggingface_hub's cache (offline here: no hub is reachable),
an HF checkpoint directory, converted once into Clover's cache and answering with its AR base's greedy tokens.

The hub cache is written in huggingface_hub's own layout (`models--ORG--NAME/{blobs,refs,snapshots}`, blobs named by
their sha256, snapshot files linking to them), which `huggingface_hub.scan_cache_dir` reads back before any test
uses it; the twins are random transformers models saved with `save_pretrained`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import httpx
import pytest
import torch

from clover.cli.main import main

PROMPT = "Hello world. What is the weather?"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TWINS = {"tiny-org/qwen3-twin": "qwen3", "tiny-org/llama-twin": "llama"}

pytestmark = pytest.mark.usefixtures("temp_clover_cache")  # conversions land in the suite's own Clover cache


def twin(family: str, tokenizer):
    """A random Qwen3 or Llama with `tokenizer`'s vocabulary and special ids (untied: a tied random model's
    greedy answer repeats its last token, which any draft would guess)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = {"qwen3": (Qwen3Config, Qwen3ForCausalLM),
                                 "llama": (LlamaConfig, LlamaForCausalLM)}[family]
    torch.manual_seed(0)
    config = config_class(vocab_size=len(tokenizer), hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_hidden_layers=2, intermediate_size=48, tie_word_embeddings=False,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    model = model_class(config).eval()
    with torch.no_grad():  # peaked logits: greedy ties would make the comparison meaningless
        model.lm_head.weight.mul_(20)
    return model


def save_to_hub_cache(hub: Path, repo: str, files: Path, commit: str = COMMIT) -> Path:
    """`files` (a directory) as revision `main` = `commit` of model `repo` in huggingface_hub's cache `hub`."""
    storage = hub / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(files.iterdir()):
        blob = storage / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        blob.write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, chat_tokenizer) -> tuple[Path, dict]:
    """An HF_HOME whose hub cache holds the two twins; (HF_HOME, {repo: the transformers model})."""
    from huggingface_hub import scan_cache_dir

    home = tmp_path_factory.mktemp("hf-home")
    models = {}
    for repo, family in TWINS.items():
        staging = tmp_path_factory.mktemp(family)
        models[repo] = twin(family, chat_tokenizer)
        models[repo].save_pretrained(staging)
        chat_tokenizer.save_pretrained(staging)
        save_to_hub_cache(home / "hub", repo, staging)
    cached = {r.repo_id: [rev.commit_hash for rev in r.revisions] for r in scan_cache_dir(home / "hub").repos}
    assert cached == {repo: [COMMIT] for repo in TWINS}  # huggingface_hub reads the layout back
    return home, models


@pytest.fixture
def offline_hub(hf_home, monkeypatch):
    """This process's huggingface_hub pointed at the prepared cache, offline (what HF_HOME and HF_HUB_OFFLINE=1 set
    at its import)."""
    from huggingface_hub import constants

    home, models = hf_home
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return models


def greedy(model, tokenizer, n: int) -> list[int]:
    """transformers' greedy continuation of PROMPT (its eos included when it stops on one)."""
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def generate(capsys, model: str, *args: str) -> dict:
    """`clover generate --model MODEL` without its repetition defaults (the plain decoding compared here)."""
    assert main(["generate", "--model", model, "--no-chat", "--json", "--threads", "1", "--max-new-tokens", "12",
                 "--dry-multiplier", "0", "--loop-guard", "0", *args, PROMPT]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("repo", list(TWINS))
def test_a_hub_id_answers_with_its_base_greedy_tokens(offline_hub, chat_tokenizer, capsys, repo):
    want = greedy(offline_hub[repo], chat_tokenizer, 12)
    exact = generate(capsys, repo)  # the converted model's default: exact mode
    assert exact["rule"] == "exact" and exact["runner"] == "torch"
    assert exact["token_ids"] == want
    assert generate(capsys, repo, "--block-size", "1")["token_ids"] == want
    assert generate(capsys, f"{repo}@{COMMIT}")["token_ids"] == want  # a revision by its commit


def test_the_conversion_is_cached_by_revision(offline_hub, chat_tokenizer, capsys, monkeypatch, temp_clover_cache):
    from clover.conversion import cached

    repo = "tiny-org/qwen3-twin"
    first = generate(capsys, repo)
    entries = sorted(p.name for p in (temp_clover_cache / "converted").iterdir())
    assert f"tiny-org--qwen3-twin-{COMMIT}" in entries

    def refuse(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(cached, "run_conversion", refuse)
    assert generate(capsys, repo)["token_ids"] == first["token_ids"]  # reused, not converted
    assert sorted(p.name for p in (temp_clover_cache / "converted").iterdir()) == entries


def test_an_hf_directory_is_converted_once_by_its_content(hf_home, chat_tokenizer, capsys, tmp_path,
                                                          temp_clover_cache):
    home, models = hf_home
    directory = tmp_path / "Llama-twin"
    directory.mkdir()
    snapshot = home / "hub" / "models--tiny-org--llama-twin" / "snapshots" / COMMIT
    for link in snapshot.iterdir():
        (directory / link.name).write_bytes(link.read_bytes())
    want = greedy(models["tiny-org/llama-twin"], chat_tokenizer, 12)
    assert generate(capsys, str(directory))["token_ids"] == want
    converted = sorted((temp_clover_cache / "converted").glob("Llama-twin-*"))
    assert len(converted) == 1
    assert generate(capsys, str(directory))["token_ids"] == want
    assert sorted((temp_clover_cache / "converted").glob("Llama-twin-*")) == converted  # same content, same entry


def test_an_id_not_in_the_cache_offline_is_a_clear_error(offline_hub, capsys):
    assert main(["generate", "--model", "nobody/no-such-model", "--no-chat", PROMPT]) == 2
    err = capsys.readouterr().err
    assert "nobody/no-such-model" in err and "not in the hub cache" in err and "HF_HUB_OFFLINE" in err


@pytest.mark.parametrize("arg, message", [
    ("no/such/path", "no such file or directory, and not a hub id"),
    ("{file}", "a file that is not a GGUF file"),
])
def test_what_is_neither_a_path_nor_a_hub_id_is_named(capsys, tmp_path, arg, message):
    (tmp_path / "notes.txt").write_text("hi")
    arg = arg.format(file=tmp_path / "notes.txt")
    assert main(["generate", "--model", arg, "--no-chat", PROMPT]) == 2
    err = capsys.readouterr().err
    assert arg in err and message in err


@pytest.mark.parametrize("repo", list(TWINS))
def test_serve_a_hub_id_offline(hf_home, chat_tokenizer, monkeypatch, tmp_path, temp_clover_cache, repo):
    """`clover serve --model ORG/NAME` in a process started with HF_HOME and HF_HUB_OFFLINE=1 answers with the
    base's greedy tokens, and a second start serves the conversion the first left in the cache (not converted
    again: its files are the same files)."""
    from server_helpers import server_process

    home, models = hf_home
    want = chat_tokenizer.decode(greedy(models[repo], chat_tokenizer, 8), skip_special_tokens=True)
    monkeypatch.setenv("HF_HOME", str(home))  # the server's process inherits this environment
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def answer(start: int) -> str:
        with server_process(Path(repo), name=repo, timeout=180, log=tmp_path / f"server-{start}.log") as (url, _):
            r = httpx.post(f"{url}/v1/completions", json={"model": repo, "prompt": PROMPT, "max_tokens": 8,
                                                         "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def files(entry: Path) -> dict[str, tuple[int, int]]:
        return {str(p.relative_to(entry)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in entry.rglob("*")}

    assert answer(1) == want
    entry = temp_clover_cache / "converted" / f"{repo.replace('/', '--')}-{COMMIT}"
    first = files(entry)
    assert first and answer(2) == want
    assert files(entry) == first


def test_serve_names_an_id_not_in_the_cache_offline(offline_hub, capsys):
    assert main(["serve", "--model", "nobody/no-such-model", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "nobody/no-such-model" in err and "not in the hub cache" in err and "HF_HUB_OFFLINE" in err
