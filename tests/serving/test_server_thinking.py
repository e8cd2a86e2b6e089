"""The thinking budget served (`thinking_token_budget`, vLLM's request field; clover.engine.constraints.thinking) on a
checkpoint carrying Qwen3.5's real chat template: the streamed and whole `reasoning_content` hold at most N tokens,
closed by the template's own `</think>`, and the answer follows; the Responses API takes it too; bad values are a 400
naming the field. And the prefix cache never shares what differs between a thinking and a non-thinking render of the
same conversation (it is keyed by token ids: the reuse stops where the renders diverge)."""

from __future__ import annotations


import httpx
import openai
import pytest

from clover.chat_template import render_chat
from clover.engine.constraints.thinking import thinking_budget
from server_helpers import ScriptedLM, server_thread, stream_chat

NAME = "qwen35"
REASONING = "Let me think. " * 12
USER = [{"role": "user", "content": "Weather in Paris?"}]
BUDGET = 5


def script(prompt: str) -> str:
    """A Qwen3.5-family model's answer: long reasoning when the prompt opened `<think>`, then "Hello."."""
    return (REASONING + "\n</think>\n\n" if prompt.endswith("<think>\n") else "") + "Hello."


@pytest.fixture(scope="module")
def tokenizer(qwen35_tokenizer):
    return qwen35_tokenizer


@pytest.fixture(scope="module")
def url(tokenizer):
    from clover.serving import ServerOptions, create_app

    # a 4-token prefill grid: prefix reuse stops within 4 tokens of where two prompts part
    app = create_app(ScriptedLM(tokenizer, script), tokenizer, ServerOptions(served_model_name=NAME, prefill_chunk=4))
    with server_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _bounded_reasoning(tokenizer, n: int) -> str:
    """The reasoning a budget of `n` leaves: the script's first `n` tokens (as the parser strips them)."""
    return tokenizer.decode(tokenizer(REASONING, add_special_tokens=False)["input_ids"][:n]).strip()


def test_the_closing_text_is_qwen35s_own(tokenizer):
    budget = thinking_budget(BUDGET, tokenizer)
    assert tokenizer.decode(list(budget.closing_ids)) == "\n</think>\n\n"


@pytest.mark.parametrize("rule", ["exact", "threshold"])
def test_streamed_reasoning_respects_the_budget(client, tokenizer, rule):
    extra = {"thinking_token_budget": BUDGET, "rule": rule}
    content, reasoning, _, finish, order = stream_chat(client, model=NAME, messages=USER, max_tokens=24,
                                                       extra_body=extra)
    assert reasoning == _bounded_reasoning(tokenizer, BUDGET)
    assert content and "</think>" not in content and finish in ("stop", "length")
    assert order.index("content") > max(i for i, kind in enumerate(order) if kind == "reasoning")
    whole = client.chat.completions.create(model=NAME, messages=USER, max_tokens=24, extra_body=extra)
    assert (whole.choices[0].message.reasoning_content, whole.choices[0].message.content) == (reasoning, content)


def test_a_budget_larger_than_the_reasoning_or_without_thinking_changes_nothing(client):
    roomy = client.chat.completions.create(model=NAME, messages=USER, max_tokens=128,
                                           extra_body={"thinking_token_budget": 1000})
    assert roomy.choices[0].message.reasoning_content == REASONING.strip()
    assert roomy.choices[0].message.content == "Hello."
    off = client.chat.completions.create(model=NAME, messages=USER, max_tokens=16, extra_body={
        "thinking_token_budget": 0, "chat_template_kwargs": {"enable_thinking": False}})
    assert (getattr(off.choices[0].message, "reasoning_content", None), off.choices[0].message.content) == \
        (None, "Hello.")


def test_the_responses_api_takes_the_budget(url, tokenizer):
    reply = httpx.post(f"{url}/v1/responses", json={"model": NAME, "input": "Weather in Paris?",
                                                   "max_output_tokens": 24, "thinking_token_budget": 2}, timeout=60)
    assert reply.status_code == 200, reply.text
    items = reply.json()["output"]
    reasoning = [part["text"] for item in items if item["type"] == "reasoning" for part in item["content"]]
    assert reasoning == [_bounded_reasoning(tokenizer, 2)]


@pytest.mark.parametrize("route, body", [
    ("chat/completions", {"messages": USER}), ("completions", {"prompt": "Hi"}), ("responses", {"input": "Hi"})])
@pytest.mark.parametrize("bad", [-1, "5", 2.5, True])
def test_bad_budgets_are_a_400_naming_the_field(url, route, body, bad):
    reply = httpx.post(f"{url}/v1/{route}", json={"model": NAME, "max_tokens": 4, **body,
                                                 "thinking_token_budget": bad}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "thinking_token_budget"


def test_a_budget_with_logprobs_is_a_400_naming_the_field(url):
    reply = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": USER, "max_tokens": 4,
                                                           "logprobs": True, "thinking_token_budget": 3}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "thinking_token_budget"


def _ids(tokenizer, messages, thinking: bool) -> list[int]:
    return tokenizer(render_chat(tokenizer, messages, add_generation_prompt=True, enable_thinking=thinking),
                     add_special_tokens=False)["input_ids"]


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_thinking_and_non_thinking_renders_share_only_their_common_prefix(client, tokenizer):
    """The prefix cache is keyed by token ids. After a non-thinking turn (its prompt ends in an empty think block),
    the thinking render of the same conversation reuses the tokens both renders share, and so does the next turn,
    whose history renders that turn without the think block: its reuse stops where the renders part, short of
    what the first turn stored, and each answer is its own render's."""
    system = [{"role": "system", "content": "You are a weather bot. " * 6}]
    first = system + USER
    later = first + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And Rome?"}]

    def ask(messages, thinking: bool):
        return client.chat.completions.create(model=NAME, messages=messages, max_tokens=128, extra_body={
            "chat_template_kwargs": {"enable_thinking": thinking}})

    off = ask(first, False)
    assert (getattr(off.choices[0].message, "reasoning_content", None), off.choices[0].message.content) == \
        (None, "Hello.")
    stored = (len(_ids(tokenizer, first, False)) - 1) // 4 * 4  # what the first request left in the cache
    for messages in (first, later):
        ids = _ids(tokenizer, messages, True)
        # the tokens both renders share, on the grid, one token always left to prefill
        shared = min(_common(ids, _ids(tokenizer, first, False)), len(ids) - 1) // 4 * 4
        on = ask(messages, True)
        assert on.usage.prompt_tokens == len(ids)
        assert on.usage.prompt_tokens_details.cached_tokens == shared > 0
        assert on.choices[0].message.reasoning_content == REASONING.strip()
    assert shared < stored  # the next turn parts from the first's render before the end of what it stored
    again = ask(first, False)  # the same render again reuses all the grid allows (one token is left to prefill)
    assert again.usage.prompt_tokens_details.cached_tokens == stored
