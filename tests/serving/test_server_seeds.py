"""A `seed` repeats through the server: the same request with the same seed and a temperature gets the same text
whole or streamed, alone or among concurrent streams, in exact mode (whose drafts follow the server's measured
timings and its batch) and at block size 1; choice `i` of `n` is the request with seed `seed + i`."""

from __future__ import annotations

import asyncio

import openai
import pytest

from clover.engine.loops import exact
from clover.engine.drafts.cost import ForwardCost
from clover.serving import ServerOptions, create_app
from model_helpers import tiny_model
from server_helpers import server_thread

NAME = "clover-seeds"
EXACT = {"rule": "exact", "block_size": 4}
BLOCK1 = {"rule": "threshold", "block_size": 1}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def url(chat_tokenizer):
    # logits spread enough (scale 3) that sampling at 0.7 often leaves the argmax
    model = tiny_model("clover-tiny-dense", vocab_size=len(chat_tokenizer), mask_token_id=chat_tokenizer.mask_token_id,
                       eos_token_id=chat_tokenizer.eos_token_id, logit_scale=3.0)
    with pytest.MonkeyPatch.context() as patch:
        # exact mode starts from a cost table of free rows, so it drafts from its first forward; from then on the
        # steps it times decide how many, as on a real server
        patch.setattr(exact, "cost_table", lambda runner, recalibrate=False: ForwardCost.flat())
        app = create_app(model, chat_tokenizer, ServerOptions(served_model_name=NAME, prefill_chunk=16))
        with server_thread(app) as u:
            yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _user(text):
    return [{"role": "user", "content": text}]


def _chat(client, msgs, seed, extra=EXACT, **kw):
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=MAX_TOKENS, temperature=0.7, seed=seed,
                                       extra_body=extra, **kw)
    return [c.message.content for c in r.choices]


async def _streams(url, requests):
    """`requests` as concurrent streams (each `(messages, seed, delay)`, started after its delay): their texts."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        async def one(msgs, seed, delay):
            await asyncio.sleep(delay)
            chunks = await client.chat.completions.create(
                model=NAME, messages=msgs, max_tokens=MAX_TOKENS, stream=True, extra_body=EXACT,
                **({"temperature": 0.7, "seed": seed} if seed is not None else {}))
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        return await asyncio.gather(*(one(*r) for r in requests))


def test_a_seed_repeats_whole_streamed_concurrent_and_at_block_size_1(client, url):
    msgs = _user("Hello world. What is the weather?")
    whole = _chat(client, msgs, seed=5)[0]
    assert whole and _chat(client, msgs, seed=6)[0] != whole  # the seed matters: the request samples
    assert _chat(client, msgs, seed=5, extra=BLOCK1)[0] == whole  # exact mode is block size 1's sample
    chunks = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=MAX_TOKENS, temperature=0.7,
                                            seed=5, extra_body=EXACT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    # eight concurrent streams, three of them this request, joining the batch at different moments; others
    # seeded differently or greedy
    others = [(_user(f"Client {i}: def f{i}(x): return x + {i}"), None if i == 2 else 100 + i, 0.02 * i)
              for i in range(5)]
    requests = [(msgs, 5, 0.0), others[0], others[1], (msgs, 5, 0.05), others[2], others[3], (msgs, 5, 0.15),
                others[4]]
    texts = asyncio.run(_streams(url, requests))
    assert [texts[i] for i in (0, 3, 6)] == [whole] * 3
    # each other request is what it is alone
    alone = [_chat(client, m, s)[0] if s is not None else
             client.chat.completions.create(model=NAME, messages=m, max_tokens=MAX_TOKENS,
                                            extra_body=EXACT).choices[0].message.content for m, s, _ in others]
    assert [texts[i] for i in (1, 2, 4, 5, 7)] == alone


def test_choice_i_is_the_request_with_seed_plus_i(client):
    msgs = _user("Write a haiku about the sea.")
    choices = _chat(client, msgs, seed=40, n=3)
    assert len(set(choices)) > 1
    assert choices == [_chat(client, msgs, seed=40 + i)[0] for i in range(3)]
