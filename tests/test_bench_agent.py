"""benchmarks/bench_agent.py: the agent loop's mechanics through the real server stack (a scripted model served
in-process, a fake tool back-end), and the BFCL schema conversion."""

from __future__ import annotations

import json

import pytest

from script_helpers import ROOT, load_script
from server_helpers import scripted_client

bench = load_script(ROOT / "benchmarks" / "bench_agent.py", "bench_agent")

NAME = "scripted"
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}


def call(name: str, **args: object) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def script(prompt: str) -> str:
    """What the model writes, keyed on the last user message and the tool results since."""
    # tool results are rendered as user turns holding <tool_response>: the request is the last other user turn
    turns = prompt.split("<|im_start|>user\n")
    at = max(i for i, t in enumerate(turns) if i and not t.startswith("<tool_response>"))
    request, answered = turns[at], at < len(turns) - 1
    if request.startswith("loop"):  # never stops calling: the step limit ends it
        return call("add", a=1, b=1)
    if request.startswith("broken"):  # a malformed call (no comma: never a call): nothing to execute, the turn ends
        return '<tool_call>\n{"name": "add" "arguments": {"a": 1}}\n</tool_call>'
    if answered:
        return "Done."
    return call("subtract", a=1, b=2) if request.startswith("unknown") else call("add", a=2, b=3)


class FakeBackend:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def execute(self, calls: list[tuple[str, dict]]) -> list[str]:
        self.calls += calls
        return [f"result {len(self.calls)}: {a['a'] + a['b']}" for _, a in calls]


@pytest.fixture(scope="module")
def count(chat_tokenizer):
    return lambda text: len(chat_tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def client(chat_tokenizer):
    with scripted_client(chat_tokenizer, script, NAME, timeout=120) as client:
        yield client


def turns(*texts: str) -> list:
    return [bench.Turn([{"role": "user", "content": t}], [ADD]) for t in texts]


def test_tool_results_are_fed_back(client, count, monkeypatch):
    backend = FakeBackend()
    sent = []
    stream = bench.stream_answer
    monkeypatch.setattr(bench, "stream_answer", lambda c, m, messages, *a: sent.append(list(messages)) or
                        stream(c, m, messages, *a))
    run = bench.run_agent(client, NAME, turns("add please", "again"), backend, count,
                          max_steps=4, max_tokens=64)
    assert backend.calls == [("add", {"a": 2, "b": 3})] * 2
    assert run.executed == [[[("add", {"a": 2, "b": 3})], []]] * 2 and not run.forced_quit and run.error is None
    # the second request of a turn carries the assistant's call and the back-end's result for it
    assistant, tool = sent[1][-2:]
    assert assistant["tool_calls"][0]["function"]["name"] == "add"
    assert tool == {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"], "content": "result 1: 5"}
    assert [(s.turn, s.calls, s.valid_calls) for s in run.steps] == [(0, 1, 1), (0, 0, 0), (1, 1, 1), (1, 0, 0)]
    assert all(s.ttft_s <= s.total_s and s.completion_tokens > 0 for s in run.steps)
    assert run.steps[0].later_tokens > 0  # a tool call streams: its arguments come after its start
    assert run.steps[2].cached_tokens > 0  # the conversation's prefix, prefilled one turn earlier


def test_malformed_and_unknown_calls_are_counted_not_executed(client, count):
    backend = FakeBackend()
    run = bench.run_agent(client, NAME, turns("broken call", "unknown tool"), backend, count,
                          max_steps=4, max_tokens=64)
    assert backend.calls == []
    # the malformed call stays in the content: counted, nothing to answer, so the turn ends;
    # the unknown tool gets an error as its result and the model answers
    assert [(s.turn, s.calls, s.valid_calls) for s in run.steps] == [(0, 1, 0), (1, 1, 0), (1, 0, 0)]
    assert run.executed == [[[]], [[], []]] and not run.forced_quit
    assert run.steps[0].rejected == [bench.MALFORMED] and "subtract" in run.steps[1].rejected[0]


def test_a_call_block_cut_by_the_length_limit_is_counted_alike_for_every_server():
    """A looping answer cut at the limit inside a `<tool_call>` block: Clover's server drops the cut block from the
    content it streams, so reading a text-parsing server's answer drops it too (no call written by either); the
    same text ended by the model itself keeps its malformed call counted."""
    text = "Here is the report:\n\n<tool_call>\n\n<tool_call>\n\n<tool_call>\n"

    def answer(finish: str) -> bench.Answer:
        return bench.Answer(text, "", [], "", 0.1, 0.2, None, finish)

    calls, malformed, content = bench.read_calls(answer("length"), "s0")
    assert (calls, malformed, content) == ([], 0, "Here is the report:")
    calls, malformed, _ = bench.read_calls(answer("stop"), "s0")
    assert calls == [] and malformed == 3  # the unclosed block stays in the content, each opening counted


def test_step_limit_ends_the_run(client, count):
    backend = FakeBackend()
    run = bench.run_agent(client, NAME, turns("loop forever", "never reached"), backend, count,
                          max_steps=3, max_tokens=64)
    assert run.forced_quit and len(run.steps) == 3 and len(backend.calls) == 3
    assert len(run.executed) == 1  # the second user turn never ran: BFCL's checker fails the task
    ok, why = bench.check_task(bench.load_tasks("multi_turn_base", 1)[0], run.executed, "test_step_limit")
    assert not ok and "turns" in why


def test_bfcl_schemas_become_json_schema():
    docs = [{"name": "f", "description": "d", "parameters": {"type": "dict", "properties": {
        "x": {"type": "float"}, "pair": {"type": "tuple", "items": {"type": "integer"}},
        "opts": {"type": "dict", "properties": {"deep": {"type": "float"}}}}, "required": ["x"]},
        "response": {"type": "dict", "properties": {}}}]
    (tool,) = bench.openai_tools(docs)
    assert tool == {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {
            "x": {"type": "number"}, "pair": {"type": "array", "items": {"type": "integer"}},
            "opts": {"type": "object", "properties": {"deep": {"type": "number"}}}}, "required": ["x"]}}}


def test_every_multi_turn_tool_converts():
    for task in bench.load_tasks("multi_turn_miss_func", 5):
        for turn in task.turns:
            for tool in turn.tools:
                text = json.dumps(tool)
                assert '"dict"' not in text and '"float"' not in text and '"tuple"' not in text
                assert tool["function"]["parameters"]["type"] == "object" and "response" not in tool["function"]
    # miss_func: the held-out function arrives at its turn, with BFCL's message
    task = bench.load_tasks("multi_turn_miss_func", 1)[0]
    held = next(i for i, t in enumerate(task.turns) if t.messages[0]["content"] == bench.MORE_FUNCTIONS)
    assert len(task.turns[held].tools) > len(task.turns[0].tools)


def test_bfcl_checker_passes_the_ground_truth():
    task = bench.load_tasks("multi_turn_base", 2)[1]  # its ground truth uses keyword arguments only
    import ast

    executed = []
    for turn in task.ground_truth:
        calls = [(node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords})
                 for node in (ast.parse(s, mode="eval").body for s in turn)]
        executed.append([calls])
    assert bench.check_task(task, executed, "test_truth") == (True, "")
    assert not bench.check_task(task, [[[]] for _ in executed], "test_nothing")[0]


def test_the_llamacpp_server_baseline_starts_streams_and_stops(tmp_path, chat_tokenizer):
    """The `llamacpp-server` system as the benchmark runs it: llama.cpp's own server (benchmarks/llama_server.py)
    on a GGUF, healthy, answering a streamed agent request with usage, stopped after."""
    import argparse

    import openai
    from server_helpers import checkpoint_and_gguf

    _, gguf = checkpoint_and_gguf(tmp_path, chat_tokenizer, 1024)  # the tools take ~350 tokens of the prompt
    system = bench.SYSTEMS["llamacpp-server"]
    args = argparse.Namespace(gguf=str(gguf), ctx=1024, threads=1)
    with bench.ServerProcess(system.name, lambda port: system.argv(port, args), tmp_path / "server.log", threads=1,
                             startup_s=120) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120)
        assert [m.id for m in client.models.list().data] == [bench.MODEL_ID]
        answer = bench.stream_answer(client, bench.MODEL_ID, [{"role": "user", "content": "Hi"}], [ADD], 8,
                                     system.extra_body)
        assert answer.finish_reason in ("length", "stop", "tool_calls") and answer.ttft_s > 0
        assert server.peak_rss_mib() > 0
    assert server.proc.poll() is not None  # stopped with the benchmark


def test_the_llamacpp_server_systems_differ_in_speculation_and_cache_reuse_only():
    """`llamacpp-server` plain, `-ngram` with ngram-mod, `-reuse` with --cache-reuse: the same server command
    otherwise (benchmarks/llama_server.py on the same GGUF), and each marked to record the llama.cpp build."""
    import argparse

    args = argparse.Namespace(gguf="/m.gguf", ctx=4096, threads=2)
    parsed = {name: bench.llama_server.parse_args(bench.SYSTEMS[name].argv(9000, args)[2:])
              for name in ("llamacpp-server", "llamacpp-server-ngram", "llamacpp-server-reuse")}
    assert {name: (a.spec_type, a.cache_reuse) for name, a in parsed.items()} == {
        "llamacpp-server": ("none", 0), "llamacpp-server-ngram": ("ngram-mod", 0),
        "llamacpp-server-reuse": ("none", bench.CACHE_REUSE)}
    assert {(a.gguf, a.ctx, a.threads, a.alias) for a in parsed.values()} == {("/m.gguf", 4096, 2, bench.MODEL_ID)}
    assert all(bench.SYSTEMS[name].llama_cpp for name in parsed) and not bench.SYSTEMS["clover"].llama_cpp


def test_clover_on_the_llamacpp_runner_serves_the_llama_server_systems_file():
    """`clover-llamacpp` runs `clover serve --runner llamacpp --model` on the very GGUF llama-server reads, so the
    two are compared on one file (q4_0 or q8_0); `--model` still overrides it."""
    import argparse

    args = argparse.Namespace(gguf="/m-q4_0.gguf", gguf_quant="q4_0", model=None, ctx=4096, threads=2)
    argv = bench.SYSTEMS["clover-llamacpp"].argv(9000, args)
    assert argv[argv.index("--model") + 1] == "/m-q4_0.gguf" and argv[argv.index("--runner") + 1] == "llamacpp"
    server = bench.llama_server.parse_args(bench.SYSTEMS["llamacpp-server-ngram"].argv(9000, args)[2:])
    assert server.gguf == "/m-q4_0.gguf"
    assert "--model" not in bench.SYSTEMS["clover"].argv(9000, args)  # the torch systems: clover-smol itself
    args.model = "/other.gguf"
    argv = bench.SYSTEMS["clover-llamacpp"].argv(9000, args)
    assert argv[argv.index("--model") + 1] == "/other.gguf"
    assert bench.parse_args(["--gguf-quant", "q4_0"]).gguf_quant == "q4_0"


def test_the_report_gives_peak_memory_and_task_time_against_llama_server():
    def result(system, peak, wall, prompt=1000, stopped=False):
        step = {"ttft_s": 0.1, "total_s": 1.0, "later_tokens": 0, "prompt_tokens": prompt, "cached_tokens": 0,
                "completion_tokens": 5, "calls": 0, "valid_calls": 0}
        tasks = [{"id": "t0", "passed": False, "wall_s": wall, "steps": [step], "error": None},
                 {"id": "t1", "passed": False, "wall_s": 7.0, "steps": [step],
                  "error": "time budget" if stopped else None}]
        return {"system": system, "describe": system, "tasks": tasks, "summary": bench.summarize(tasks, peak)}

    results = [result("clover", 1200.0, 393.0), result("llamacpp-server", 960.0, 793.0),
               result("llamacpp-server-ngram", 1000.0, 493.0, prompt=1010)]
    assert bench.against_llama_server(results) == [
        "`clover` against `llamacpp-server`: peak RSS 1.25x, task time 0.50x (400.0 s against 800.0 s over 2 tasks).",
        "`clover` against `llamacpp-server-ngram`: peak RSS 1.20x, task time 0.80x (400.0 s against 500.0 s over 2 "
        "tasks)."]
    # a task the time budget stopped on one side is left out of both
    stopped = [results[0], result("llamacpp-server", 960.0, 793.0, stopped=True)]
    assert bench.against_llama_server(stopped) == [
        "`clover` against `llamacpp-server`: peak RSS 1.25x, task time 0.50x (393.0 s against 793.0 s over 1 task)."]
    assert "peak RSS 1.25x" in bench.markdown(results, {"category": "c", "tasks": 1, "command": "x", "machine": "m"})
    assert bench.against_llama_server(results[:1]) == []
    # a llama-server that read other prompts (its template rendered no tools) gets no ratio
    unfair = [results[0], result("llamacpp-server", 960.0, 300.0, prompt=65)]
    assert bench.against_llama_server(unfair) == [
        "`clover` against `llamacpp-server`: no ratio, the prompts differ (2000 against 130 prompt tokens)."]


def test_llama_server_reads_the_tools_clover_writes_into_a_template_without_them():
    """clover-smol's template renders no tools: clover serve writes them into the messages (Hermes form); the agent
    sends llama-server the same text, so both prefill the same prompt."""
    from clover.chat_template import hermes_messages, normalize_messages, render_chat
    from clover.smol import clover_smol_dir
    from clover.tokenizer import load_tokenizer

    args = bench.parse_args([])
    assert bench.tools_as_text(bench.SYSTEMS["llamacpp-server-ngram"], args)
    assert not bench.tools_as_text(bench.SYSTEMS["clover-llamacpp"], args)
    assert not bench.tools_as_text(bench.SYSTEMS["clover"], args)
    tokenizer = load_tokenizer(clover_smol_dir())
    tools = [{"type": "function", "function": {"name": "ls", "description": "list", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}]
    chat = [{"role": "system", "content": "S."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "ls", "arguments": '{"a": "x"}'}}]},
            {"role": "tool", "tool_call_id": "1", "content": "out"}]
    sent = hermes_messages(normalize_messages(chat), tools)
    assert render_chat(tokenizer, sent, None, add_generation_prompt=True) == \
        render_chat(tokenizer, chat, tools, add_generation_prompt=True)


def test_a_replay_sends_the_recorded_requests_whatever_the_server_answers(client, count, monkeypatch, tmp_path):
    """`--replay`: the conversation a run recorded is sent again request by request (each a prefix of it, with its
    turn's tools); this server's answers are timed and counted, never executed or fed back."""
    live = bench.run_agent(client, NAME, turns("add please", "again"), FakeBackend(), count, max_steps=4,
                           max_tokens=64)
    # user; + call, result; + answer, user; + call, result
    assert live.requests == [(0, 1), (0, 3), (1, 5), (1, 7)]
    path = tmp_path / "x.conversations.jsonl.gz"
    bench.write_conversations(path, [{"id": "t0", "conversation": live.conversation, "requests": live.requests}])
    recorded = bench.read_conversations(path)["t0"]
    assert recorded["conversation"] == json.loads(json.dumps(live.conversation))
    # the recorded tool result is what the replay sends, not a result of its own
    recorded["conversation"][2]["content"] = "result 1: 42"
    sent = []
    stream = bench.stream_answer
    monkeypatch.setattr(bench, "stream_answer", lambda c, m, messages, tools, *a: sent.append((list(messages), tools))
                        or stream(c, m, messages, tools, *a))
    replay = bench.replay_agent(client, NAME, turns("add please", "again"), recorded["conversation"],
                                [tuple(r) for r in recorded["requests"]], count, max_tokens=64)
    assert [len(m) for m, _ in sent] == [1, 3, 5, 7] and all(tools == [ADD] for _, tools in sent)
    assert sent[1][0][2]["content"] == "result 1: 42" and sent[3][0] == recorded["conversation"][:7]
    assert [(s.turn, s.calls, s.valid_calls) for s in replay.steps] == [(0, 1, 1), (0, 0, 0), (1, 1, 1), (1, 0, 0)]
    assert replay.executed == [] and replay.error is None


def test_a_replay_file_that_is_not_one_is_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "t0"}\n')
    with pytest.raises(SystemExit, match="no task conversations"):
        bench.read_conversations(bad)
    with pytest.raises(SystemExit, match="not a conversations file"):
        bench.read_conversations(tmp_path / "missing.jsonl.gz")
