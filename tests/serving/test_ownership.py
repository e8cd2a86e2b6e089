"""One owner of the model, options per request, cancellation that always works, memory within its budget:
every runner call runs on the scheduler thread under mixed requests; thresholds and ignore_eos are per row of one
batch and thousands of option sets leave a bounded set of engines; a failed choice frees its siblings' slots; a
departed client's decision stops; a long prompt's in-flight snapshots stay within the prefix cache's budget."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest
import torch
from pydantic import BaseModel

from clover.engine import Engine, RequestOptions, SamplingParams, generate
from clover.engine.loops.decision import DecisionRun
from clover.serving import ServerOptions, create_app
from clover.serving.scheduling.handles import until_disconnect
from clover.serving.scheduling.prefix_cache import PrefixCache, snapshot_bytes
from clover.serving.api.protocol import APIError
from clover.serving.scheduling.scheduler import MAX_IDLE_ENGINES, Scheduler
from clover.serving.served_model import read_generation_defaults
from model_helpers import PROMPTS, tiny_model
from server_helpers import ConciseLM, server_thread
from test_server_grammar import TOOLS

NAME = "clover-owner"


class RecordingLM(ConciseLM):
    """ConciseLM that records the thread of every call the runner makes into it (forward, new_cache)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.threads: list[str] = []

    def new_cache(self, batch_size: int):
        self.threads.append(threading.current_thread().name)
        return super().new_cache(batch_size)

    def forward(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        return super().forward(*args, **kwargs)


class Form(BaseModel):  # inside decision mode's form subset
    ok: bool


class Item(BaseModel):  # outside it: the grammar path
    sku: str
    qty: int


def test_every_runner_call_runs_on_the_scheduler_thread_under_mixed_requests(chat_tokenizer):
    model = tiny_model("clover-tiny-dense", vocab_size=len(chat_tokenizer), mask_token_id=chat_tokenizer.mask_token_id,
                       eos_token_id=chat_tokenizer.eos_token_id, logit_scale=3.0)
    lm = RecordingLM(model, chat_tokenizer)
    # the default rule is not exact: grammar and strict-tool requests need an engine made on demand (calibrated)
    app = create_app(lm, chat_tokenizer, ServerOptions(served_model_name=NAME, prefill_chunk=16, rule="threshold"))
    user = [{"role": "user", "content": "Go."}]
    with server_thread(app) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        async def run():
            return await asyncio.gather(
                client.chat.completions.create(model=NAME, messages=user, max_tokens=12),
                client.chat.completions.create(model=NAME, messages=user, max_tokens=12,
                                               extra_body={"threshold": 0.6}),
                client.chat.completions.create(model=NAME, messages=user, max_tokens=12,
                                               extra_body={"rule": "left_to_right"}),
                client.chat.completions.create(model=NAME, messages=user, max_tokens=12,
                                               extra_body={"rule": "exact"}, stream=True),
                client.chat.completions.parse(model=NAME, messages=user, response_format=Item, max_tokens=60),
                client.chat.completions.create(model=NAME, messages=user, tools=TOOLS, tool_choice="required",
                                               max_tokens=80),
                client.chat.completions.parse(model=NAME, messages=user, response_format=Form))

        results = asyncio.run(run())
    assert len(results) == 7 and all(r is not None for r in results)
    assert results[-1].model_extra["decision"]  # the decision path ran too
    assert len(lm.threads) > 20
    assert set(lm.threads) == {"clover-scheduler"}, sorted(set(lm.threads))


# -- options per request -----------------------------------------------------------------------------------------
async def _tokens(handle):
    out = [[] for _ in range(handle.n)]
    async for piece in handle:
        out[handle.choice(piece)] += piece.token_ids
    return out


@pytest.fixture(scope="module")
def hybrid():
    return tiny_model("clover-tiny")


def test_thresholds_and_ignore_eos_are_per_row_of_one_batch(hybrid):
    prompt = PROMPTS[1]
    base = generate(hybrid, [prompt], 16, block_size=4, threshold=0.5, eos_token_ids=[]).sequences[0]
    eos = [base[5]]  # an id the default decoding emits: rows that heed it stop there
    sched = Scheduler(hybrid, block_size=4, threshold=0.5, eos_token_ids=eos, prefill_chunk=8)
    sched.start()
    options = [dict(threshold=0.3), dict(threshold=0.9), dict(ignore_eos=True), dict(threshold=0.7, ignore_eos=True),
               {}]
    batch_sizes = []
    step = sched.policy.step_running

    def observed_step():
        batch_sizes.extend(len(b.seqs) for b in sched.policy.batches.values())
        step()

    sched.policy.step_running = observed_step

    async def run():
        handles = [await sched.submit(prompt, 16, [RequestOptions(**o)]) for o in options]
        return await asyncio.gather(*(_tokens(h) for h in handles))

    try:
        results = asyncio.run(run())
    finally:
        sched.stop()
    for o, (got,) in zip(options, results):
        alone = generate(hybrid, [prompt], 16, block_size=4, threshold=o.get("threshold", 0.5),
                         eos_token_ids=[] if o.get("ignore_eos") else eos).sequences[0]
        assert got == alone, o
    assert len(results[4][0]) < 16 == len(results[2][0])  # EOS stopped the default row, not the ignore_eos one
    assert len(sched.engines) == 1 and max(batch_sizes) >= 4  # one engine, one batch: mixed rows stepped together


def test_two_thousand_option_sets_leave_a_bounded_set_of_engines(hybrid):
    sched = Scheduler(hybrid, block_size=4, threshold=0.5, eos_token_ids=[], prefill_chunk=8)
    sched.start()
    keys = [(b, r) for b in (2, 3, 5, 6) for r in ("threshold", "left_to_right", "product_threshold")]
    assert len(keys) > MAX_IDLE_ENGINES + 1  # engines beyond the bound must be evicted

    async def wave(first: int, count: int) -> None:
        handles = []
        for i in range(first, first + count):  # each a distinct option set: its threshold, ignore_eos, engine
            block_size, rule = keys[(i - first) * len(keys) // count]  # in runs of one engine: prefilled together
            own = RequestOptions(threshold=0.05 + 0.9 * i / 2000, ignore_eos=bool(i % 2))
            handles.append(await sched.submit(PROMPTS[i % 2], 1, [own], block_size=block_size, rule=rule))
        await asyncio.gather(*(_tokens(h) for h in handles))

    async def run():
        for first in range(0, 2000, 48):
            await wave(first, 48)
            await asyncio.sleep(0.01)  # the last releases land
            assert len(sched.engines) <= MAX_IDLE_ENGINES + 1  # idle ones, and the default

    try:
        asyncio.run(run())
    finally:
        sched.stop()
    assert sched._outstanding == 0 and not sched._live


# -- cancellation --------------------------------------------------------------------------------------------------
def test_a_failing_choice_frees_its_siblings_slots(hybrid):
    sched = Scheduler(hybrid, block_size=4, threshold=0.5, eos_token_ids=[], prefill_chunk=4, max_running=4)
    sched.start()
    engine = sched.engines[sched.default_key]
    prefill_step, failed = engine.prefill_step, []

    def failing_prefill_step(p):  # the second choice's prefill fails; the first is already decoding by then
        if p.seq.options.sampling.seed == 3:
            failed.append(True)
            raise RuntimeError("out of memory")
        return prefill_step(p)

    engine.prefill_step = failing_prefill_step

    async def run():  # PROMPTS[2] is longer than a chunk: the two choices prefill one after the other
        handle = await sched.submit(PROMPTS[2], 4000, [SamplingParams(), SamplingParams(temperature=0.8, seed=3)])
        with pytest.raises(RuntimeError, match="out of memory"):
            await asyncio.wait_for(_tokens(handle), 60)
        for _ in range(500):
            if sched._outstanding == 0:
                break
            await asyncio.sleep(0.01)
        return sched.load

    try:
        load = asyncio.run(run())
    finally:
        sched.stop()
    assert failed == [True]
    # the sibling (4000 tokens to go) left its batch: nothing runs, nothing is outstanding
    assert sched._outstanding == 0 and load["running"] == 0 and not sched.policy.jobs


def test_a_departed_clients_decision_stops(chat_tokenizer):
    model = tiny_model("clover-tiny-dense", vocab_size=len(chat_tokenizer), mask_token_id=chat_tokenizer.mask_token_id,
                       eos_token_id=chat_tokenizer.eos_token_id, logit_scale=3.0)
    sched = Scheduler(model, eos_token_ids=[chat_tokenizer.eos_token_id], prefill_chunk=16, max_running=2)
    sched.start()
    steps, release = threading.Event(), threading.Event()
    schema = {"type": "object", "properties": {f"f{i}": {"type": "boolean"} for i in range(8)},
              "required": [f"f{i}" for i in range(8)]}
    run = DecisionRun.create(sched.runner, chat_tokenizer, [[{"role": "user", "content": "Decide."}]], schema)
    step = run.step

    ended = []

    def slow_step():  # a slow forward: the client leaves long before the run could end
        steps.set()
        release.wait(0.2)
        ended.append(step())
        return ended[-1]

    run.step = slow_step

    class Departing:  # the ASGI request of a client that leaves once its decision is running
        async def receive(self):
            await asyncio.to_thread(steps.wait, 30)
            return {"type": "http.disconnect"}

    async def go():
        with pytest.raises(APIError) as err:
            await until_disconnect(Departing(), sched.decide(run))
        assert err.value.status == 499
        for _ in range(500):
            if sched._outstanding == 0:
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(go())
        running = sched.load["running"]
    finally:
        release.set()
        sched.stop()
    assert ended and not any(ended)  # it stopped before its last forward
    assert sched._outstanding == 0 and running == 0 and not sched.policy.deciding


# -- memory within the budget ----------------------------------------------------------------------------------------
def test_a_32k_prompt_on_a_hybrid_twin_keeps_its_snapshots_within_a_small_prefix_budget(hybrid):
    chunk = 256
    one = Engine(hybrid, 4, 0.5, eos_token_ids=[], prefill_chunk=chunk)
    probe = one.begin_prefill(one.make_sequences([[1] * (chunk + 1)], 1, SamplingParams())[0])
    one.prefill_step(probe)
    snap = snapshot_bytes(probe.cache, probe.cache.snapshot())
    assert snap > 0
    budget = 6 * snap  # room for six snapshots; the prompt passes 128 grid points
    store = PrefixCache(chunk, budget, recurrent=True)
    sched = Scheduler(hybrid, block_size=4, threshold=0.5, eos_token_ids=[], prefill_chunk=chunk, prefix_cache=store)
    peak = []
    prefill_once = sched.policy.prefill_once

    def observed():  # the store and the prefill's snapshots (measured, not as counted), after each prefill chunk
        prefill_once()
        job = sched.policy.prefilling
        alone = None if job is None else job.prefill
        held = 0 if alone is None else sum(snapshot_bytes(alone.progress.cache, s) for s in alone.states.values())
        peak.append(held + store.memory_bytes)

    sched.policy.prefill_once = observed
    sched.start()
    prompt = [int(t) for t in torch.randint(0, 250, (32 * 1024 + 5,), generator=torch.Generator().manual_seed(0))]

    async def run():
        return await _tokens(await sched.submit(prompt, 2, [SamplingParams()]))

    try:
        asyncio.run(run())
    finally:
        sched.stop()
    # without the budget the prefill held 128 snapshots (~21x the budget) until it ended
    assert max(peak) <= budget
    assert store.in_flight_bytes == 0


def test_a_malformed_generation_config_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "generation_config.json"
    for text in ('{"temperature": 0.7', "[0.7]", '{"temperature": "hot"}'):
        path.write_text(text)
        with pytest.raises(ValueError, match="generation_config.json"):
            read_generation_defaults(tmp_path)
    path.write_text('{"temperature": 0.7, "top_p": 0.9}')
    assert read_generation_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.9}
    path.unlink()
    assert read_generation_defaults(tmp_path) == {}  # none: the defaults (greedy)
