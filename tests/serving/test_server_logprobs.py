"""Logprobs through the official `openai` client: chat `logprobs` / `top_logprobs` and the completions API's
`logprobs` with `echo`, streamed and not, in OpenAI's shapes; exact mode's values are block size 1's, an echoed
prompt's are a causal forward's; the bounds are 400s naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from clover.chat_template import render_chat
from clover.engine import Engine, RequestOptions
from clover.engine.logprobs import banned_ids, log_probs
from clover.serving import ServerOptions, create_app
from clover.serving.locked_tokenizer import LockedTokenizer
from model_helpers import tiny_model
from server_helpers import server_thread

NAME = "clover-logprobs"
EXACT = {"rule": "exact", "block_size": 4}


@pytest.fixture(scope="module")
def model(chat_tokenizer):
    return tiny_model("clover-tiny-dense", vocab_size=len(chat_tokenizer), mask_token_id=chat_tokenizer.mask_token_id,
                      eos_token_id=chat_tokenizer.eos_token_id, logit_scale=3.0)


@pytest.fixture(scope="module")
def url(model, chat_tokenizer):
    app = create_app(model, chat_tokenizer, ServerOptions(served_model_name=NAME, prefill_chunk=16))
    with server_thread(app) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _user(text):
    return [{"role": "user", "content": text}]


def _block1(model, tokenizer, prompt, max_new, top):
    """Block size 1's tokens and values offline (the reference exact mode must match)."""
    engine = Engine(model, 1, eos_token_ids=[tokenizer.eos_token_id], vocab_limit=len(tokenizer))
    values = []
    for e in engine.run([prompt], max_new, RequestOptions.of(logprobs=top)):
        values += e.logprobs
    return values


def _names(tokenizer, ids):
    return tokenizer.batch_decode([[i] for i in ids])


def test_chat_logprobs_are_block_size_1s_streamed_and_not(client, model, chat_tokenizer):
    msgs = _user("Hello world. What is the weather?")
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, logprobs=True, top_logprobs=3,
                                       extra_body=EXACT)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    prompt = chat_tokenizer(render_chat(chat_tokenizer, msgs, add_generation_prompt=True),
                            add_special_tokens=False)["input_ids"]
    ref = _block1(model, chat_tokenizer, prompt, 16, 3)
    assert [c.token for c in content] == _names(chat_tokenizer, [v.token for v in ref])
    torch.testing.assert_close(torch.tensor([c.logprob for c in content]), torch.tensor([v.logprob for v in ref]),
                               atol=1e-5, rtol=1e-5)
    own = LockedTokenizer(chat_tokenizer).token_bytes([v.token for v in ref])
    for c, v, raw in zip(content, ref, own):
        assert c.bytes == list(raw)  # the token's own bytes (its text's UTF-8 unless it holds part of a character)
        assert "\ufffd" in c.token or raw == c.token.encode("utf-8")
        assert [t.token for t in c.top_logprobs] == _names(chat_tokenizer, [t for t, _ in v.top])
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([lp for _, lp in v.top], abs=1e-5)
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, logprobs=True,
                                                 top_logprobs=3, extra_body=EXACT, stream=True))
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    # (how many drafts a forward verifies follows measured timings: its sums may differ in the last bits)
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == r.choices[0].message.content


def test_no_logprobs_unless_asked_and_the_same_answer(client):
    msgs = _user("List three colours.")
    plain = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12)
    asked = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, logprobs=True)
    assert plain.choices[0].logprobs is None
    assert asked.choices[0].message.content == plain.choices[0].message.content
    assert all(c.top_logprobs == [] for c in asked.choices[0].logprobs.content)


def test_completion_echo_logprobs_score_the_prompt_causally(client, model, chat_tokenizer):
    text = "The weather is"
    r = client.completions.create(model=NAME, prompt=text, max_tokens=8, echo=True, logprobs=2, extra_body=EXACT)
    lp = r.choices[0].logprobs
    ids = chat_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
    assert lp.tokens[:len(ids)] == _names(chat_tokenizer, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), block_size=1).logits[0]
    banned = torch.tensor(banned_ids(model.config.mask_token_id, len(chat_tokenizer), model.config.vocab_size))
    causal = log_probs(logits[:-1], banned).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(causal.tolist(), abs=1e-5)
    for i, top in enumerate(lp.top_logprobs[1:], 1):  # the two best and the token itself, keyed by text
        assert 1 <= len(top) <= 3 and top[lp.tokens[i]] >= lp.token_logprobs[i] - 1e-6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.choices[0].text.startswith(text)
    chunks = list(client.completions.create(model=NAME, prompt=text, max_tokens=8, echo=True, logprobs=2,
                                            extra_body=EXACT, stream=True))
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs:
            for key in streamed:
                streamed[key] += getattr(chunk.choices[0].logprobs, key)
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    plain = client.completions.create(model=NAME, prompt=text, max_tokens=8, logprobs=0, extra_body=EXACT)
    assert plain.choices[0].logprobs.tokens == lp.tokens[len(ids):]
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[len(ids):], abs=1e-5)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": _user("hi"), "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": _user("hi"), "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": _user("hi"), "top_logprobs": 2}, None),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
])
def test_logprob_bounds_are_400s_naming_the_field(url, path, body, param):
    r = httpx.post(f"{url}{path}", json={"model": NAME, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and ("top_logprobs" if param is None else param) in error["message"]


def test_twenty_alternatives_are_served(client):
    r = client.chat.completions.create(model=NAME, messages=_user("hi"), max_tokens=2, logprobs=True,
                                       top_logprobs=20)
    assert all(len(c.top_logprobs) == 20 for c in r.choices[0].logprobs.content)
