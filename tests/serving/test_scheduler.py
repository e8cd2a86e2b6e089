"""Continuous batching: requests that join a running batch at block boundaries, or leave it at any step, get
exactly what they get alone; the scheduler thread keeps that under concurrency, backpressure and cancellation."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from clover.engine import Engine, RequestOptions, SamplingParams, generate
from clover.serving.metrics import ServerMetrics
from clover.serving.scheduling.prefix_cache import PrefixCache
from clover.serving.scheduling.scheduler import QueueFull, Scheduler
from clover.serving.scheduling.scheduler_policy import DecisionJob, Job, SchedulePolicy
from model_helpers import PROMPTS, tiny_model

PROMPTS = PROMPTS + [list(range(30, 57))]
MAX_NEW = [18, 9, 14, 11]


@pytest.fixture(scope="module")
def models():
    return {"clover-tiny": tiny_model("clover-tiny"), "clover-tiny-dense": tiny_model("clover-tiny-dense")}


def _alone(model, prompt, max_new, sampling, eos):
    return generate(model, [prompt], max_new, block_size=4, threshold=0.5, options=sampling,
                    eos_token_ids=eos).sequences[0]


def _continuous(engine: Engine, arrivals: list[int], sampling: list[SamplingParams], drop: dict[int, int]):
    """Request i arrives at step `arrivals[i]` and joins at the next block boundary; request j leaves at step
    `drop[j]` (cancelled). Returns the tokens each request received."""
    seqs = [engine.make_sequences([p], m, s)[0] for p, m, s in zip(PROMPTS, MAX_NEW, sampling)]
    for i, s in enumerate(seqs):
        s.seq_id = i
    out = {i: [] for i in range(len(seqs))}
    batch, step, waiting = None, 0, list(range(len(seqs)))
    joined_mid_run = 0
    while waiting or batch is not None:
        if batch is None or engine.at_block_boundary(batch):
            for i in [i for i in waiting if arrivals[i] <= step]:
                prefill, new = engine.begin_prefill(seqs[i]), None
                while new is None:
                    new = engine.prefill_step(prefill)
                joined_mid_run += batch is not None
                batch = engine.join(batch, new)
                waiting.remove(i)
        gone = {j for j, at in drop.items() if at == step}
        if batch is not None and gone:
            batch = engine.drop(batch, gone)
        if batch is not None:
            events, batch = engine.step(batch)
            for e in events:
                out[e.seq_id] += e.token_ids
        step += 1
    assert joined_mid_run >= 2  # the test really exercises joins into a running batch
    return out


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
@pytest.mark.parametrize("sampled", [False, True])
def test_rows_joining_a_running_batch_get_what_they_get_alone(models, preset, sampled):
    model = models[preset]
    base = [generate(model, [p], 20, block_size=4, threshold=0.5, eos_token_ids=[]).sequences[0] for p in PROMPTS]
    others = {t for i, seq in enumerate(base) if i != 1 for t in seq}
    # request 1 ends early on EOS (and leaves the batch); the others run to their limits
    eos = [next(t for i, t in enumerate(base[1]) if i >= 2 and t not in others and t not in base[1][:i])]
    engine = Engine(model, 4, 0.5, eos_token_ids=eos, prefill_chunk=8)
    sampling = [SamplingParams(temperature=0.9, top_p=0.95, seed=i) if sampled else SamplingParams()
                for i in range(len(PROMPTS))]
    got = _continuous(engine, arrivals=[0, 0, 2, 3], sampling=sampling, drop={})
    for i, prompt in enumerate(PROMPTS):
        assert got[i] == _alone(model, prompt, MAX_NEW[i], sampling[i], eos), i


def test_a_dropped_row_leaves_the_others_untouched(models):
    model = models["clover-tiny"]
    engine = Engine(model, 4, 0.5, eos_token_ids=[], prefill_chunk=8)
    sampling = [SamplingParams()] * len(PROMPTS)
    got = _continuous(engine, arrivals=[0, 0, 2, 5], sampling=sampling, drop={1: 6})  # 6: mid-block
    for i in (0, 2, 3):
        assert got[i] == _alone(model, PROMPTS[i], MAX_NEW[i], sampling[i], [])
    assert len(got[1]) < MAX_NEW[1]


# -- the scheduler thread ------------------------------------------------------------------------------------------
async def _collect(handle):
    tokens = [[] for _ in range(handle.n)]
    async for out in handle:
        tokens[handle.choice(out)] += out.token_ids
    return tokens


def _scheduler(model, **kw):
    kw.setdefault("prefill_chunk", 8)
    return Scheduler(model, block_size=4, threshold=0.5, eos_token_ids=[], **kw)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_scheduler_serves_concurrent_requests_exactly(models, prefix_cache):
    model = models["clover-tiny"]
    store = PrefixCache(8, 1 << 30, recurrent=True) if prefix_cache else None
    sched = _scheduler(model, prefix_cache=store, max_running=3)
    sched.start()
    prompts = PROMPTS + [PROMPTS[3] + [7, 7, 7]]  # the last one shares a prefix with the one before

    async def run():
        handles = [await sched.submit(p, 10, [SamplingParams(), SamplingParams(temperature=0.7, seed=1)])
                   for p in prompts]
        return await asyncio.gather(*(_collect(h) for h in handles)), handles

    try:
        results, handles = asyncio.run(run())
    finally:
        sched.stop()
    for prompt, tokens in zip(prompts, results):
        assert tokens[0] == _alone(model, prompt, 10, SamplingParams(), [])
        assert tokens[1] == _alone(model, prompt, 10, SamplingParams(temperature=0.7, seed=1), [])
    if prefix_cache:
        assert max(handles[-1].cached_tokens) == 24 and store.stats.hits >= 1
    assert sched._outstanding == 0 and not sched.policy.jobs


def test_scheduler_backpressure_and_cancellation_free_slots(models):
    model = models["clover-tiny-dense"]
    sched = _scheduler(model, max_running=1, max_waiting=1)
    sched.start()

    async def run():
        long = await sched.submit(PROMPTS[0], 2000, [SamplingParams()])
        queued = await sched.submit(PROMPTS[1], 2000, [SamplingParams()])
        with pytest.raises(QueueFull):
            await sched.submit(PROMPTS[2], 4, [SamplingParams()])
        first = await long.__aiter__().__anext__()
        assert first.token_ids
        long.cancel()
        queued.cancel()
        for _ in range(200):
            if sched._outstanding == 0:
                break
            await asyncio.sleep(0.02)
        assert sched._outstanding == 0 and sched.load["running"] == 0
        return await _collect(await sched.submit(PROMPTS[2], 4, [SamplingParams()]))

    try:
        tokens = asyncio.run(run())
    finally:
        sched.stop()
    assert tokens[0] == _alone(model, PROMPTS[2], 4, SamplingParams(), [])


def test_requests_with_other_decoding_options_run_in_their_own_batch(models):
    model = models["clover-tiny"]
    sched = _scheduler(model)
    sched.start()

    async def run():
        a = await sched.submit(PROMPTS[0], 12, [SamplingParams()])
        b = await sched.submit(PROMPTS[1], 12, [RequestOptions(threshold=0.3)], block_size=2)
        c = await sched.submit(PROMPTS[1], 12, [SamplingParams()], rule="left_to_right")
        return await asyncio.gather(_collect(a), _collect(b), _collect(c))

    try:
        (a,), (b,), (c,) = asyncio.run(run())
    finally:
        sched.stop()
    assert a == _alone(model, PROMPTS[0], 12, SamplingParams(), [])
    assert b == generate(model, [PROMPTS[1]], 12, block_size=2, threshold=0.3, eos_token_ids=[]).sequences[0]
    assert c == generate(model, [PROMPTS[1]], 12, block_size=4, threshold=0.5, rule="left_to_right",
                         eos_token_ids=[]).sequences[0]
    assert len(sched.engines) == 3


# -- failures: every request gets an answer, and the loop keeps serving ---------------------------------------------
async def _error(handle):
    """The exception a request ends with (a timeout here means a request was left hanging)."""
    with pytest.raises(Exception) as info:
        await asyncio.wait_for(_collect(handle), 30)
    assert not isinstance(info.value, asyncio.TimeoutError), "the request was left hanging"
    return info.value


def test_a_commit_failing_after_rows_finished_fails_them_too(models):
    """`Engine.step` drops finished rows before its commit forward: if that forward raises, the rows that had just
    finished must be failed as well (they are no longer in the batch)."""
    model = models["clover-tiny-dense"]
    sched = _scheduler(model)
    sched.start()
    engine = sched.engines[sched.default_key]
    finish, commit, raised = engine.loop._finish_block, engine.loop._commit, []

    def finish_block(b):
        events = finish(b)
        engine.dropped = any(e.finished for e in events) and bool(b.seqs)
        return events

    def failing_commit(b):
        if getattr(engine, "dropped", False) and not raised:
            raised.append(True)
            raise RuntimeError("out of memory")
        commit(b)

    engine.loop._finish_block, engine.loop._commit = finish_block, failing_commit

    async def run():
        long = await sched.submit(PROMPTS[0], 40, [SamplingParams()])
        short = await sched.submit(PROMPTS[1], 4, [SamplingParams()])  # finishes in its first block, next to `long`
        errors = await asyncio.gather(_error(long), _error(short))
        return errors, await _collect(await sched.submit(PROMPTS[2], 8, [SamplingParams()]))

    try:
        errors, tokens = asyncio.run(run())
    finally:
        sched.stop()
    assert raised and all("out of memory" in str(e) for e in errors)
    assert tokens[0] == _alone(model, PROMPTS[2], 8, SamplingParams(), [])
    assert sched._outstanding == 0 and not sched.policy.jobs


def test_a_prefix_lookup_error_fails_one_request_not_the_loop(models):
    model = models["clover-tiny"]
    store = PrefixCache(8, 1 << 30, recurrent=True)
    find = store.find

    def picky_lookup(tokens, scope=None):  # (only prompts longer than a chunk are looked up: PROMPTS[2] is)
        if tokens == PROMPTS[2]:
            raise ValueError("bad prompt")
        return find(tokens, scope)

    store.find = picky_lookup
    sched = _scheduler(model, prefix_cache=store)
    sched.start()

    async def run():
        bad = await sched.submit(PROMPTS[2], 8, [SamplingParams()])
        good = await sched.submit(PROMPTS[0], 8, [SamplingParams()])
        error = await _error(bad)
        assert sched.alive  # one request failed; the loop lives on
        return error, await _collect(good)

    try:
        error, tokens = asyncio.run(run())
    finally:
        sched.stop()
    assert isinstance(error, ValueError) and sched.error is None
    assert tokens[0] == _alone(model, PROMPTS[0], 8, SamplingParams(), [])
    assert sched._outstanding == 0 and not sched.policy.jobs


def test_stop_fails_requests_still_in_the_inbox_and_submit_refuses_after(models):
    sched = _scheduler(models["clover-tiny-dense"])
    with pytest.raises(RuntimeError):  # not started: nothing would ever take it
        asyncio.run(_submit_now(sched))
    busy, release = threading.Event(), threading.Event()
    step = sched.policy.step_running

    def held_step():  # holds the loop inside an iteration, so a new request stays in the inbox
        busy.set()
        release.wait(30)
        step()

    sched.policy.step_running = held_step
    sched.start()

    async def run():
        running = await sched.submit(PROMPTS[0], 400, [SamplingParams()])
        await asyncio.to_thread(busy.wait, 30)
        queued = await sched.submit(PROMPTS[1], 8, [SamplingParams()])
        stopper = threading.Thread(target=sched.stop)
        stopper.start()
        while not sched._stop:
            await asyncio.sleep(0.01)
        with pytest.raises(RuntimeError):  # stopping: refused at once
            await sched.submit(PROMPTS[2], 8, [SamplingParams()])
        release.set()
        await asyncio.to_thread(stopper.join)
        return await _error(running), await _error(queued)

    errors = asyncio.run(run())
    assert all("shutting down" in str(e) for e in errors)
    assert sched._outstanding == 0 and not sched._inbox
    with pytest.raises(RuntimeError):
        asyncio.run(_submit_now(sched))


async def _submit_now(sched):
    return await sched.submit(PROMPTS[0], 4, [SamplingParams()])


# -- the policy, without threads -------------------------------------------------------------------------------------
class _Handle:
    """What the policy needs of a request's handle: an id, per-choice cached counts, a place for outputs."""

    def __init__(self, request_id: int) -> None:
        self.id, self.cached_tokens, self.items = request_id, [0], []

    def choice_of(self, seq_id: int) -> int:
        return 0

    def deliver(self, item) -> None:
        self.items.append(item)


def _policy(model, max_running: int):
    engine = Engine(model, 4, 0.5, eos_token_ids=[], prefill_chunk=8)
    key = (4, "threshold")
    released = []
    policy = SchedulePolicy({key: engine}, None, max_running, ServerMetrics(), released.append)
    jobs = []
    for i, (prompt, max_new) in enumerate(zip(PROMPTS, MAX_NEW)):
        seq = engine.make_sequences([prompt], max_new, [SamplingParams()])[0]
        seq.seq_id = i
        jobs.append(Job(_Handle(i), seq, key, engine))
    return policy, engine, jobs, released


def test_policy_admits_up_to_max_running_and_joins_only_at_block_boundaries(models):
    model = models["clover-tiny"]
    policy, engine, jobs, released = _policy(model, max_running=2)
    policy.add(jobs)
    joined_mid_run, iterations = 0, 0
    with torch.inference_mode():
        while policy.busy():
            policy.prefill_once()
            assert policy.running_count() <= 2  # admission never exceeds max_running
            before = {j.seq.seq_id for group, _ in policy.ready for j in group}
            had_batch = bool(policy.batches)
            policy.join_ready()
            for group, _ in policy.ready:  # what stays ready waits for its batch's block boundary
                assert not engine.at_block_boundary(policy.batches[group[0].key])
            joined_mid_run += had_batch and len(before) > sum(len(group) for group, _ in policy.ready)
            policy.step_running()
            iterations += 1
            assert iterations < 1000
    assert joined_mid_run >= 1  # requests 2 and 3 joined a running batch once a slot was free
    assert sorted(j.seq.seq_id for j in released) == [0, 1, 2, 3] and not policy.jobs
    for job, prompt, max_new in zip(jobs, PROMPTS, MAX_NEW):
        out = job.handle.items
        assert out[-1].finished and not any(o.finished for o in out[:-1])
        assert [t for o in out for t in o.token_ids] == _alone(model, prompt, max_new, SamplingParams(), [])


def test_short_prompts_are_prefilled_together_in_one_forward(models):
    """Prompts of one prefill chunk or less share one forward (within the free capacity), longer ones go alone,
    chunk by chunk; every request still gets what it gets alone, and a cancelled one leaves its group."""
    model = models["clover-tiny"]
    for max_running, groups in ((4, [[0, 1]]), (1, [[0]])):
        policy, engine, jobs, _ = _policy(model, max_running=max_running)
        assert [len(p) <= engine.prefill_chunk for p in PROMPTS] == [True, True, False, False]
        policy.add(jobs)
        with torch.inference_mode():
            before = engine.counters.forwards
            policy.prefill_once()
            assert engine.counters.forwards == before + 1
            assert [[j.seq.seq_id for j in group] for group, _ in policy.ready] == groups
            while policy.busy():
                policy.prefill_once()
                policy.join_ready()
                policy.step_running()
        for job, prompt, max_new in zip(jobs, PROMPTS, MAX_NEW):
            assert [t for o in job.handle.items for t in o.token_ids] == _alone(model, prompt, max_new,
                                                                                SamplingParams(), [])
    policy, _, jobs, released = _policy(model, max_running=4)
    policy.add(jobs)
    with torch.inference_mode():
        policy.prefill_once()
        policy.cancel({0})
        assert [[j.seq.seq_id for j in group] for group, _ in policy.ready] == [[1]]
        while policy.busy():
            policy.prefill_once()
            policy.join_ready()
            policy.step_running()
    assert jobs[0].handle.items == [] and sorted(j.seq.seq_id for j in released) == [0, 1, 2, 3]
    assert [t for o in jobs[1].handle.items for t in o.token_ids] == _alone(model, PROMPTS[1], MAX_NEW[1],
                                                                           SamplingParams(), [])


def test_policy_cancellation_drops_waiting_and_running_requests(models):
    policy, _, jobs, released = _policy(models["clover-tiny"], max_running=1)
    policy.add(jobs[:2])
    with torch.inference_mode():
        while not policy.batches:
            policy.prefill_once()
            policy.join_ready()
        policy.step_running()
        assert [j.seq.seq_id for j in policy.waiting] == [1]  # max_running=1: request 1 still waits
        delivered = len(jobs[0].handle.items)
        policy.cancel({0, 1})
        assert not policy.busy() and not policy.jobs and sorted(j.seq.seq_id for j in released) == [0, 1]
        policy.step_running()  # nothing left to step: no more outputs
    assert len(jobs[0].handle.items) == delivered and jobs[1].handle.items == []


def test_a_failing_group_prefill_fails_only_the_bad_request(models, monkeypatch):
    """Short prompts are prefilled as a group; when that forward fails, each is retried alone, so only the request
    that fails alone fails (one client's bad request never fails another's)."""
    model = models["clover-tiny"]
    policy, engine, jobs, released = _policy(model, max_running=4)
    together = engine.prefill_together

    def poisoned(seqs):
        if any(s.seq_id == 0 for s in seqs):
            raise RuntimeError("Overflow when unpacking long long")
        return together(seqs)

    monkeypatch.setattr(engine, "prefill_together", poisoned)
    policy.add(jobs)
    with torch.inference_mode():
        while policy.busy():
            policy.prefill_once()
            policy.join_ready()
            policy.step_running()
    assert len(jobs[0].handle.items) == 1 and isinstance(jobs[0].handle.items[0], RuntimeError)
    for job, prompt, max_new in list(zip(jobs, PROMPTS, MAX_NEW))[1:]:
        assert [t for o in job.handle.items for t in o.token_ids] == _alone(model, prompt, max_new,
                                                                            SamplingParams(), [])
    assert sorted(j.seq.seq_id for j in released) == [0, 1, 2, 3] and not policy.jobs


class _Run:
    """A decision run's shape without a model: `rows` prompts, done after `steps` steps."""

    def __init__(self, rows: int, steps: int) -> None:
        self.prompts, self.steps = [[0]] * rows, steps

    def step(self) -> bool:
        self.steps -= 1
        return self.steps == 0

    def results(self) -> list[str]:
        return ["decided"] * len(self.prompts)


def _admissions(policy: SchedulePolicy, work: list[Job | DecisionJob]) -> list[tuple[int, str]]:
    """(iteration, job) in the order the policy admits `work`, run as the scheduler runs it (prefill, join, step
    once per iteration): work is admitted when it leaves the waiting queue."""
    name = {id(w): f"G{w.handle.id}" if isinstance(w, Job) else f"D{w.id}" for w in work}
    seen, order = set(), []
    policy.add(work)
    with torch.inference_mode():
        for iteration in range(1000):
            if not policy.busy():
                return order
            for phase in (policy.prefill_once, policy.join_ready, policy.step_running):
                phase()
                queued = {id(w) for w in policy.waiting}
                order += [(iteration, name[id(w)]) for w in work if id(w) not in queued | seen]
                seen |= {id(w) for w in work} - queued
    raise AssertionError("the policy never went idle")


@pytest.mark.parametrize("max_running, want", [
    (1, [(0, "D10"), (3, "G0"), (12, "G1"), (20, "D11"), (22, "G2"), (31, "G3")]),
    (2, [(0, "D10"), (0, "G0"), (3, "G1"), (14, "D11"), (16, "G2"), (18, "G3")]),
    (3, [(0, "D10"), (0, "G0"), (0, "G1"), (8, "D11"), (10, "G2"), (12, "G3")]),
])
def test_the_policy_admits_requests_and_decision_runs_in_this_order(models, max_running, want):
    """Pins the admission order (and iteration) of mixed work under `max_running`: requests (G: handle id) and
    decision runs (D: job id), submitted together in the order D10 (1 row), G0, G1 (short prompts, prefilled
    together), D11 (2 rows), G2, G3. Arrival order (first come, first served): one queue, admitted at one point
    (an iteration's start), the oldest first while it fits; work that does not fit holds back all behind it."""
    policy, _, jobs, released = _policy(models["clover-tiny"], max_running=max_running)
    runs = [DecisionJob(10, _Run(1, 3), [].append), DecisionJob(11, _Run(2, 2), [].append)]
    work = [runs[0], jobs[0], jobs[1], runs[1], jobs[2], jobs[3]]
    got = _admissions(policy, work)
    assert [name for _, name in got] == ["D10", "G0", "G1", "D11", "G2", "G3"]
    assert got == want
    assert len(released) == 6 and not policy.jobs


def test_a_decision_run_submitted_first_is_admitted_first(models):
    """One slot, a decision run queued before a request: the run is admitted first and the request only once the
    run has freed its row (3 steps: iterations 0-2), however short the request's prompt; the request still gets
    what it gets alone. A queued run whose client leaves is dropped from the same queue, its rows freed."""
    model = models["clover-tiny"]
    policy, _, jobs, released = _policy(model, max_running=1)
    decided = []
    run = DecisionJob(10, _Run(1, 3), decided.append)
    assert _admissions(policy, [run, jobs[0]]) == [(0, "D10"), (3, "G0")]
    assert decided == [["decided"]] and released == [run, jobs[0]]
    assert [t for o in jobs[0].handle.items for t in o.token_ids] == _alone(model, PROMPTS[0], MAX_NEW[0],
                                                                           SamplingParams(), [])
    policy, _, jobs, released = _policy(model, max_running=1)
    gone, behind = [], DecisionJob(11, _Run(1, 1), [].append)
    policy.add([jobs[0], DecisionJob(10, _Run(1, 3), gone.append), behind])
    with torch.inference_mode():
        policy.prefill_once()
        policy.cancel({10})
    assert isinstance(gone[0], RuntimeError) and [w.id for w in policy.waiting] == [11]
    assert policy.load["waiting"] == 1 and released[-1].id == 10
