"""Agents end to end: an OpenAI-API agent loop on BFCL multi-turn tasks, against several servers.

    python benchmarks/bench_agent.py [--systems clover llamacpp-server] [--tasks 2] [--category multi_turn_base]
        [--max-steps 20] [--max-tokens 256] [--threads 1] [--request-timeout 300] [--budget-s 1800]
        [--model DIR] [--replay OUT/SYSTEM.conversations.jsonl.gz] [--out benchmarks/results/bench_agent]

Each system is a server the script starts itself on a free 127.0.0.1 port, waits for, and stops after its tasks
(also on Ctrl-C, SIGTERM or an error):

* `clover`: `clover serve` with its defaults (clover-smol, int4, exact mode, a drafting memory per API key);
* `clover-no-memory`: the same with `--draft-memory off` (drafts from each request's own context only);
* `clover-b1`: `clover serve --block-size 1 --rule threshold` (one token per forward, the AR baseline);
* `clover-llamacpp`: `clover serve --runner llamacpp` (Clover's engine on llama.cpp's kernels) on the same GGUF
  as the llama-server systems (`--gguf`, or clover-smol's export at `--gguf-quant`, q8_0 by default);
* `llamacpp-server`: llama.cpp's own OpenAI server (its C++ `llama-server`, through xllamacpp:
  benchmarks/llama_server.py) on the same GGUF, with the chat template the GGUF carries (Clover's) and llama.cpp's
  tool-call parsing;
* `llamacpp-server-ngram`: the same with its draft-free n-gram speculation, `--spec-type ngram-mod` (the build's
  defaults: n-grams of 24 tokens hashed into one pool that every request fills and drafts from, drafts of 48-64);
* `llamacpp-server-reuse`: the same as `llamacpp-server` with `--cache-reuse 256` (chunks of the last prompt
  reused by KV shifting beyond the common prefix).

Each llama.cpp system's results name the build it ran (`llama_cpp_build`: the xllamacpp version and the llama.cpp
release it carries).

The agent (`run_agent`) is the loop agent frameworks run, on the official `openai` client: send the conversation
and the tools, stream the answer, execute its tool calls, append the results as `tool` messages, repeat until
the model answers without a call (then the next user turn) or `--max-steps` requests in one user turn (BFCL's
limit, 20: the task is then failed, as BFCL fails a forced quit). Tool calls are the server's `tool_calls` plus
any Hermes `<tool_call>` blocks left in the content, read by the client: a server may return a call it does not
parse as text, and `clover serve` leaves malformed ones there.

Every system reads the same prompt text. Where the model's own template renders no tools (clover-smol's, SmolLM2's),
`clover serve` writes the tools, calls and results into the messages in the Hermes form
(`clover.chat_template.hermes_messages`); llama-server would render such a chat without any tools, so the agent sends
it the messages already written that way (and no `tools`), and reads its calls from the content. The report gives
no ratio between systems whose prompt-token totals differ by more than 2 %: they did not serve the same work.

Tasks are BFCL's multi-turn categories (`bfcl-eval`'s data): the tools of the task's classes (BFCL's schema
dialect converted to JSON Schema), executed by bfcl-eval's own back-end classes (GorillaFileSystem, TwitterAPI,
...), and each task scored by bfcl-eval's `multi_turn_checker` (state of every back-end instance and the
execution results against the ground truth's, turn by turn), exactly as BFCL scores a model.

Live, each system feeds its own answers back, so two systems whose answers differ serve different prompts from the
first difference on (their task times then measure different work). `--replay FILE` makes it the same work: every
live run writes the conversation each task sent (`OUT/<system>.conversations.jsonl.gz`: the messages after its last
request and, per request, its turn and how many of them it sent), and a replay sends those requests again, in
order, to every system: the same prompts whatever each answers; each answer is streamed, timed and its calls
counted, none executed or fed back, and no task scored. A server's KV of its own answer is then never in the next
prompt (the recorded answer is): every system re-reads it, as a server does whose answer another system wrote.

Figures per system: task accuracy, tool calls that parse and name a real tool, total task time, time to first
token (streamed) of each task's first request and of the later ones, decode tokens/s (completion tokens over
the time after the first token), prompt tokens served from the server's prefix cache
(`usage.prompt_tokens_details.cached_tokens`, where the server reports it), and the server's peak resident
memory (VmHWM). For the Clover systems also, from the request log each one writes (`--record-requests`, under
`--out`): tokens per forward over every request and over each task's later requests, the tokens its drafting
memories hold after the run (`/metrics`), and a digest of every answer's token ids, so the systems that must write
the same answers (the memory on and off) are compared token for token. Written as JSON, Markdown and a plot under
`--out`.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import signal
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_server  # noqa: E402  (benchmarks/, next to this script)
from bench_server import machine  # noqa: E402  (the same)
from server_process import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_ID = "bench"
# llama-server --cache-reuse: the smallest chunk of the last prompt reused by KV shifting (what llama.vim's README runs)
CACHE_REUSE = 256
BFCL_MAX_STEPS = 20  # BFCL's MAXIMUM_STEP_LIMIT: requests per user turn before a forced quit
# BFCL's user message at a turn that brings held-out functions (the miss_func category)
MORE_FUNCTIONS = "I have updated some more functions you can choose from. What about now?"
MALFORMED = "a <tool_call> that does not parse, left in the content"
_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")


# -- tasks: BFCL multi-turn --------------------------------------------------------------------------------------------
@dataclass
class Turn:
    messages: list[dict[str, Any]]  # the user's messages of this turn
    tools: list[dict[str, Any]]  # the tools offered from this turn on (OpenAI format)


@dataclass
class Task:
    id: str
    turns: list[Turn]
    initial_config: dict[str, Any]
    involved_classes: list[str]
    ground_truth: list[list[str]]  # per turn, the expected calls as Python call strings
    entry: dict[str, Any]  # the BFCL test entry, as the checker reads it


def openai_tools(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """BFCL function docs as OpenAI tools: BFCL's types ("dict", "float", "tuple") as JSON Schema's ("object",
    "number", "array"); the docs' `response` schema, which OpenAI's format has no field for, dropped."""
    from clover.training.bfcl import bfcl_tools

    return bfcl_tools([{k: v for k, v in fn.items() if k != "response"} for fn in functions])


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_tasks(category: str, limit: int) -> list[Task]:
    """The first `limit` tasks of a BFCL multi-turn category, with their tools per turn (held-out functions of
    `miss_func` arrive at their turn, with BFCL's user message)."""
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    from clover.training.bfcl import bfcl_data_dir

    data = bfcl_data_dir()
    files = sorted(data.glob(f"BFCL_v*_{category}.json"))
    if not category.startswith("multi_turn") or not files:
        found = sorted(p.name for p in data.glob("BFCL_v*_multi_turn_*.json"))
        raise SystemExit(f"unknown multi-turn category {category!r}; files: {found}")
    answers = {row["id"]: row["ground_truth"] for row in _read_jsonl(data / "possible_answer" / files[-1].name)}
    tasks = []
    for entry in _read_jsonl(files[-1])[:limit]:
        docs = [fn for cls in entry["involved_classes"]
                for fn in _read_jsonl(data / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls])]
        missed = entry.get("missed_function", {})
        held = {name for names in missed.values() for name in names}
        offered = [fn for fn in docs if fn["name"] not in held]
        turns = []
        for i, messages in enumerate(entry["question"]):
            if str(i) in missed:
                offered = offered + [fn for fn in docs if fn["name"] in missed[str(i)]]
                messages = [{"role": "user", "content": MORE_FUNCTIONS}]
            turns.append(Turn(messages, openai_tools(offered)))
        tasks.append(Task(entry["id"], turns, entry.get("initial_config", {}), entry["involved_classes"],
                          answers[entry["id"]], entry))
    return tasks


# -- tool back-ends ----------------------------------------------------------------------------------------------------
class ToolBackend(Protocol):
    def execute(self, calls: list[tuple[str, dict[str, Any]]]) -> list[str]:
        """One result text per call, in order."""


def call_string(name: str, args: dict[str, Any]) -> str:
    """A call as BFCL writes an OpenAI tool call for its executor: `name(k=repr(v),...)`."""
    return f"{name}({','.join(f'{k}={v!r}' for k, v in args.items())})"


class BFCLBackend:
    """The task's bfcl-eval back-end instances (GorillaFileSystem, ...), loaded with its initial state.

    bfcl-eval keeps its instances in its executor module's globals, keyed by a model name and the task id, so that
    a task's state persists from call to call; `run_name` keeps runs apart and `close` frees them."""

    def __init__(self, task: Task, run_name: str) -> None:
        self.task, self.run_name = task, run_name
        self.long_context = "long_context" in task.id
        self.execute([])  # create the instances from the initial state now, not at the first call

    def execute(self, calls: list[tuple[str, dict[str, Any]]]) -> list[str]:
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import execute_multi_turn_func_call

        results, _ = execute_multi_turn_func_call(
            [call_string(n, a) for n, a in calls], self.task.initial_config, self.task.involved_classes,
            self.run_name, self.task.id, long_context=self.long_context, is_evaL_run=False)
        return results

    def close(self) -> None:
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

        prefix = re.sub(r"[-./:]", "_", self.run_name)
        for key in [k for k in vars(multi_turn_utils) if k.startswith(prefix)]:
            del vars(multi_turn_utils)[key]


def check_task(task: Task, executed: list[list[list[tuple[str, dict[str, Any]]]]], run_name: str) -> tuple[bool, str]:
    """bfcl-eval's multi-turn checker on the calls the agent made (per turn, per step). A run that did not reach
    every turn fails, as BFCL fails a forced quit."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    if len(executed) != len(task.ground_truth):
        return False, f"ran {len(executed)} of {len(task.ground_truth)} turns"
    decoded = [[[call_string(n, a) for n, a in step] for step in turn if step] for turn in executed]
    try:
        result = multi_turn_checker(decoded, task.ground_truth, task.entry, task.id.rsplit("_", 1)[0], run_name)
    finally:  # the checker makes its own instances (run_name + "_eval", "_ground_truth_eval")
        prefix = re.sub(r"[-./:]", "_", run_name)
        for key in [k for k in vars(multi_turn_utils) if k.startswith(prefix)]:
            del vars(multi_turn_utils)[key]
    return bool(result["valid"]), result.get("error_type", "")


# -- the agent loop ----------------------------------------------------------------------------------------------------
@dataclass
class Call:
    id: str
    name: str
    arguments: str  # as the model wrote them (a JSON string)
    args: dict[str, Any] | None  # parsed; None when they are not a JSON object


@dataclass
class Step:
    """One request: an assistant answer, its timing and its calls."""
    turn: int
    ttft_s: float
    total_s: float
    prompt_tokens: int | None
    completion_tokens: int
    later_tokens: int  # completion tokens that arrived after the first delta (decode tokens/s is theirs)
    cached_tokens: int | None
    calls: int  # tool calls the model wrote (parsed or not)
    valid_calls: int  # that parse and name a tool offered
    rejected: list[str]  # why each of the others was not executed
    finish_reason: str | None


@dataclass
class AgentRun:
    steps: list[Step] = field(default_factory=list)
    executed: list[list[list[tuple[str, dict[str, Any]]]]] = field(default_factory=list)  # turn, step, calls
    forced_quit: bool = False  # a user turn reached the step limit
    error: str | None = None  # what stopped the run early (timeout, context full, the time budget)
    # the conversation as it stood after the last request (it only grows: each request sent a prefix of it), and
    # per request (turn, messages sent): what `--replay` sends again
    conversation: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Answer:
    """A streamed answer, accumulated: the assistant message to append, its calls, its timing and usage."""
    content: str
    reasoning: str
    tool_calls: list[dict[str, str]]  # {"id", "name", "arguments"} as streamed
    later_text: str  # what arrived after the first non-empty delta (tool calls as the model writes them)
    ttft_s: float
    total_s: float
    usage: Any
    finish_reason: str | None


def stream_answer(client: Any, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                  max_tokens: int, extra_body: dict[str, Any]) -> Answer:
    """One streamed chat request, accumulated as agent frameworks do (tool-call deltas joined by index)."""
    start = time.perf_counter()
    first, later = None, []
    content, reasoning, calls, usage, finish = "", "", {}, None, None
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=tools, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra_body)
    for chunk in stream:
        usage = getattr(chunk, "usage", None) or usage
        for choice in chunk.choices:
            d = choice.delta
            text = getattr(d, "reasoning_content", None) or ""
            if first is not None:
                later += [text, d.content or ""] + [_call_text(tc) for tc in d.tool_calls or [] if tc.function]
            elif d.content or text or d.tool_calls:
                first = time.perf_counter()
            content += d.content or ""
            reasoning += text
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    end = time.perf_counter()
    return Answer(content, reasoning, [calls[i] for i in sorted(calls)], "".join(later), (first or end) - start,
                  end - start, usage, finish)


def _call_text(call: Any) -> str:
    """A streamed tool-call delta as the model wrote it (Hermes format, Clover's template), for counting its tokens:
    a call's start (it has an id) is its opening, name and closing, a later delta its arguments' fragment."""
    function = call.function
    if call.id is None:
        return function.arguments or ""
    return f'<tool_call>\n{{"name": "{function.name or ""}", "arguments": {function.arguments or ""}}}\n</tool_call>'


def _parse_args(text: str) -> dict[str, Any] | None:
    try:
        args = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return None
    return args if isinstance(args, dict) else None


def read_calls(answer: Answer, step_id: str) -> tuple[list[Call], int, str]:
    """(calls with ids, malformed calls left in the content, the content without the calls read from it).

    The server's calls first, then the well-formed `<tool_call>` blocks of the content (servers that do not parse
    them); a `<tool_call>` that does not parse stays in the content and is counted as malformed. A block the length
    limit cut is dropped, as Clover's server drops it from the content it streams (`parse_assistant_output`'s
    `cut`): so every server's answer is counted alike (a looping answer's `<tool_call>`s, cut at the limit, are
    no calls written in either)."""
    from clover.assistant_output import parse_assistant_output

    calls = [Call(c["id"] or f"call_{step_id}_{i}", c["name"], c["arguments"], _parse_args(c["arguments"]))
             for i, c in enumerate(answer.tool_calls)]
    content, _, found = parse_assistant_output(answer.content, cut=answer.finish_reason == "length")
    for c in found:
        fn = c["function"]
        calls.append(Call(f"call_{step_id}_{len(calls)}", fn["name"], fn["arguments"], json.loads(fn["arguments"])))
    return calls, content.count("<tool_call>"), content


def call_problem(call: Call, names: set[str]) -> str | None:
    """Why a call cannot be executed (its result then), or None. Names and argument names must be identifiers:
    bfcl-eval executes a call as Python text."""
    if call.args is None:
        return f"Error: the arguments of {call.name} are not a JSON object: {call.arguments}"
    if call.name not in names or not _IDENTIFIER.match(call.name):
        return f"Error: there is no tool named {call.name!r}"
    bad = [k for k in call.args if not _IDENTIFIER.match(k)]
    return f"Error: {call.name} has no parameter {bad[0]!r}" if bad else None


def run_agent(client: Any, model: str, turns: list[Turn], backend: ToolBackend, count_tokens: Callable[[str], int], *,
              max_steps: int = BFCL_MAX_STEPS, max_tokens: int = 256, deadline: float = float("inf"),
              extra_body: dict[str, Any] | None = None, tools_as_text: bool = False) -> AgentRun:
    """Run a multi-turn task: per user turn, request -> execute the calls -> `tool` messages -> request ...,
    until an answer has no call that can be answered, or `max_steps` requests (a forced quit: the run stops).

    Calls that parse and name an offered tool are executed by `backend` (all of a step's calls in one batch, in
    order); the others get an error as their tool result. Errors from the server (a timeout, a full context) and
    the `deadline` (time.monotonic()) stop the run with `error` set. `count_tokens` (text -> tokens) counts the
    tokens of first deltas, and completion tokens for servers that report no usage in streams. `tools_as_text`:
    the tools, calls and results sent written into the messages in the Hermes form, no `tools` (module docstring)."""
    import openai

    run = AgentRun()
    messages = run.conversation
    for t, turn in enumerate(turns):
        messages += turn.messages
        names = {tool["function"]["name"] for tool in turn.tools}
        run.executed.append([])
        for s in range(max_steps + 1):
            if s == max_steps:
                run.forced_quit = True
                return run
            if time.monotonic() > deadline:
                run.error = "time budget"
                return run
            run.requests.append((t, len(messages)))
            try:
                answer = send(client, model, messages, turn.tools, max_tokens, extra_body or {}, tools_as_text)
            except openai.APIError as exc:
                run.error = f"{type(exc).__name__}: {str(exc)[:200]}"
                return run
            step, calls, problems, content = judge(t, answer, f"{t}_{s}", names, count_tokens)
            valid = [c for c in calls if problems[c.id] is None]
            run.steps.append(step)
            run.executed[-1].append([(c.name, c.args) for c in valid])
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if answer.reasoning:
                message["reasoning_content"] = answer.reasoning
            if calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            messages.append(message)
            if not calls:
                break
            results = dict(zip((c.id for c in valid), backend.execute([(c.name, c.args) for c in valid])))
            messages += [{"role": "tool", "tool_call_id": c.id, "content": problems[c.id] or results[c.id]}
                         for c in calls]
    return run


def send(client: Any, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int,
         extra_body: dict[str, Any], tools_as_text: bool) -> Answer:
    """One request of the conversation `messages` with `tools` offered, as `stream_answer`; `tools_as_text`: the
    tools, calls and results written into the messages in the Hermes form instead (module docstring)."""
    if tools_as_text:
        from clover.chat_template import hermes_messages, normalize_messages

        return stream_answer(client, model, hermes_messages(normalize_messages(messages), tools), [], max_tokens,
                             extra_body)
    return stream_answer(client, model, messages, tools, max_tokens, extra_body)


def replay_agent(client: Any, model: str, turns: list[Turn], conversation: list[dict[str, Any]],
                 requests: list[tuple[int, int]], count_tokens: Callable[[str], int], *, max_tokens: int = 256,
                 deadline: float = float("inf"), extra_body: dict[str, Any] | None = None,
                 tools_as_text: bool = False) -> AgentRun:
    """A recorded run's requests sent again (`--replay`): request `(t, n)` is the first `n` messages of the
    recorded `conversation` with turn `t`'s tools, whatever this server answered before, so every system replaying
    the same recording prefills the same prompts. Each answer is timed and its calls counted as `run_agent` counts
    them; none is executed or fed back, and the run is not scored. Errors and the `deadline` stop it as they stop
    `run_agent`."""
    import openai

    run = AgentRun(conversation=conversation, requests=requests)
    for i, (t, n) in enumerate(requests):
        if time.monotonic() > deadline:
            run.error = "time budget"
            break
        tools = turns[t].tools
        try:
            answer = send(client, model, conversation[:n], tools, max_tokens, extra_body or {}, tools_as_text)
        except openai.APIError as exc:
            run.error = f"{type(exc).__name__}: {str(exc)[:200]}"
            break
        names = {tool["function"]["name"] for tool in tools}
        run.steps.append(judge(t, answer, f"{t}_{i}", names, count_tokens)[0])
    return run


def judge(turn: int, answer: Answer, step_id: str, names: set[str],
          count_tokens: Callable[[str], int]) -> tuple[Step, list[Call], dict[str, str | None], str]:
    """An answer's calls read (`read_calls`) and judged (`call_problem`), and its request's record (`_step`): what
    `run_agent` and `replay_agent` count alike. Returns the record, the calls, each call's problem by its id (None:
    it can run) and the content without the calls."""
    calls, malformed, content = read_calls(answer, step_id)
    problems = {c.id: call_problem(c, names) for c in calls}
    rejected = [p for p in problems.values() if p] + [MALFORMED] * malformed
    valid = sum(p is None for p in problems.values())
    return _step(turn, answer, len(calls) + malformed, valid, rejected, count_tokens), calls, problems, content


def _step(turn: int, answer: Answer, calls: int, valid: int, rejected: list[str],
          count_tokens: Callable[[str], int]) -> Step:
    """A request's record. Tokens after the first delta: a server that holds text back (clover serve sends a tool
    call whole once it is closed) delivers much of an answer in its first delta, after a wait that is not decode
    time alone; counting only what follows keeps decode tokens/s a rate over time actually measured."""
    usage = answer.usage
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    if usage is not None:
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
    else:
        text = answer.reasoning + answer.content + "".join(c["name"] + c["arguments"] for c in answer.tool_calls)
        prompt, completion = None, count_tokens(text)
    later = count_tokens(answer.later_text) if answer.later_text else 0
    return Step(turn, answer.ttft_s, answer.total_s, prompt, completion, later, cached, calls, valid, rejected,
                answer.finish_reason)


# -- systems: servers started and stopped by the benchmark -------------------------------------------------------------
@dataclass(frozen=True)
class System:
    name: str
    describe: str
    argv: Callable[[int, argparse.Namespace], list[str]]  # the server's command for a port
    health: str  # a path that answers 200 once the model is loaded
    extra_body: dict[str, Any] = field(default_factory=dict)
    llama_cpp: bool = False  # runs llama.cpp: its results name the build
    clover: bool = False  # `clover serve`: its requests are recorded (--record-requests) and its memory read


def _gguf(args: argparse.Namespace) -> str:
    """The GGUF the llama.cpp systems read: `--gguf`, else clover-smol's export at `--gguf-quant`."""
    from clover.smol import clover_smol_gguf

    return args.gguf or str(clover_smol_gguf(args.gguf_quant))


def _clover(*flags: str, gguf: bool = False) -> Callable[[int, argparse.Namespace], list[str]]:
    """`clover serve` with `flags`; `gguf`: on the llama.cpp systems' file (unless `--model` names another)."""
    def argv(port: int, args: argparse.Namespace) -> list[str]:
        model = ["--model", args.model] if args.model else ["--model", _gguf(args)] if gguf else []
        return [sys.executable, "-m", "clover.cli.main", "serve", *model, "--port", str(port), "--served-model-name",
                MODEL_ID, "--threads", str(args.threads), "--log-level", "warning", *flags]
    return argv


def _llamacpp_server(spec_type: str = "none", cache_reuse: int = 0) -> Callable[[int, argparse.Namespace], list[str]]:
    def argv(port: int, args: argparse.Namespace) -> list[str]:
        return llama_server.command(_gguf(args), port, alias=MODEL_ID, ctx=args.ctx, threads=args.threads,
                                    spec_type=spec_type, cache_reuse=cache_reuse)
    return argv


SYSTEMS = {s.name: s for s in (
    System("clover", "clover serve (defaults)", _clover(), "/health", clover=True),
    System("clover-no-memory", "clover serve --draft-memory off", _clover("--draft-memory", "off"), "/health",
           clover=True),
    System("clover-b1", "clover serve --block-size 1 --rule threshold", _clover("--block-size", "1", "--rule",
                                                                                   "threshold"), "/health", clover=True),
    System("clover-llamacpp", "clover serve --runner llamacpp (the llama.cpp systems' GGUF)",
           _clover("--runner", "llamacpp", gguf=True), "/health",
           llama_cpp=True, clover=True),
    # no repetition penalty, greedy as the others are (llama-server's default already; kept explicit)
    System("llamacpp-server", "llama.cpp's llama-server (same GGUF)", _llamacpp_server(), "/health",
           {"repeat_penalty": 1.0}, llama_cpp=True),
    System("llamacpp-server-ngram", "llama-server --spec-type ngram-mod", _llamacpp_server("ngram-mod"), "/health",
           {"repeat_penalty": 1.0}, llama_cpp=True),
    System("llamacpp-server-reuse", f"llama-server --cache-reuse {CACHE_REUSE}",
           _llamacpp_server(cache_reuse=CACHE_REUSE), "/health", {"repeat_penalty": 1.0}, llama_cpp=True),
)}


# -- one system over the tasks -----------------------------------------------------------------------------------------
def token_counter(args: argparse.Namespace) -> Callable[[str], int]:
    """Completion tokens of a text, for servers that report no usage in streams (the GGUF shares clover-smol's
    vocabulary)."""
    from clover.smol import clover_smol_dir
    from clover.tokenizer import load_tokenizer  # not AutoTokenizer: it reads config.json and warns on `clover`

    tokenizer = load_tokenizer(args.model or clover_smol_dir())
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def tools_as_text(system: System, args: argparse.Namespace) -> bool:
    """Whether the agent writes the tools into the messages for `system`: a llama.cpp server on a model whose
    template renders none (module docstring)."""
    from clover.chat_template import checkpoint_template, renders_tools
    from clover.smol import clover_smol_dir
    from clover.tokenizer import load_tokenizer

    if not system.llama_cpp or system.clover:
        return False
    tokenizer = load_tokenizer(args.model or clover_smol_dir())
    return not renders_tools(tokenizer, checkpoint_template(tokenizer))


def run_task(client: Any, system: System, task: Task, args: argparse.Namespace, deadline: float,
             count: Callable[[str], int], as_text: bool, recorded: dict[str, Any] | None = None) -> dict[str, Any]:
    """One task: the agent against its own bfcl-eval back-end, then the checker; its record. With `recorded` (a
    line of a conversations file: `--replay`) its requests sent again instead, not scored."""
    run_name = f"bench_agent_{system.name}_{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    if recorded is not None:
        run = replay_agent(client, MODEL_ID, task.turns, recorded["conversation"],
                           [(t, n) for t, n in recorded["requests"]], count, max_tokens=args.max_tokens,
                           deadline=deadline, extra_body=system.extra_body, tools_as_text=as_text)
    else:
        backend = BFCLBackend(task, run_name)
        try:
            run = run_agent(client, MODEL_ID, task.turns, backend, count, max_steps=args.max_steps,
                            max_tokens=args.max_tokens, deadline=deadline, extra_body=system.extra_body,
                            tools_as_text=as_text)
        finally:
            backend.close()
    wall = time.perf_counter() - start
    if run.error or run.forced_quit:
        passed, why = False, run.error or "forced quit"
    elif recorded is not None:
        passed, why = False, "replayed: not scored"
    else:
        passed, why = check_task(task, run.executed, run_name)
    print(f"  {system.name} {task.id}: {'pass' if passed else 'fail'} ({why or 'ok'}), {len(run.steps)} requests, "
          f"{wall:.1f} s", flush=True)
    return {"id": task.id, "passed": passed, "why": why, "wall_s": wall, "forced_quit": run.forced_quit,
            "error": run.error, "steps": [asdict(s) for s in run.steps],
            "calls": [[[call_string(n, a) for n, a in step] for step in turn] for turn in run.executed],
            "conversation": {"id": task.id, "conversation": run.conversation, "requests": run.requests}}


def run_system(system: System, tasks: list[Task], args: argparse.Namespace, budget_s: float,
               replay: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Start the system's server, run the tasks (none started after `budget_s`; with `replay`, task id -> its
    recorded conversation, those sent again), stop it. Live, the conversations each task sent are written to
    `--out`/<system>.conversations.jsonl.gz (what `--replay` reads)."""
    import openai

    count, as_text = token_counter(args), tools_as_text(system, args)
    records = []
    log = Path(args.out) / f"{system.name}.requests.jsonl"  # clover serve's record of every request
    log.unlink(missing_ok=True)
    record = ["--record-requests", str(log)] if system.clover else []
    memory = prefix_cache = None
    with ServerProcess(system.name, lambda port: system.argv(port, args) + record,
                       Path(args.out) / f"{system.name}.log", threads=args.threads, health=system.health) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                               timeout=args.request_timeout)
        # first-call costs (kernels, allocator) off the figures: one short request, another prompt
        stream_answer(client, MODEL_ID, [{"role": "user", "content": "Hi"}], [], 4, system.extra_body)
        deadline = time.monotonic() + budget_s
        for task in tasks:
            if time.monotonic() > deadline:
                break
            records.append(run_task(client, system, task, args, deadline, count, as_text,
                                    replay[task.id] if replay is not None else None))
        peak = server.peak_rss_mib()
        if system.clover:
            metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
            memory, prefix_cache = draft_memory_tokens(metrics), prefix_cache_mib(metrics)
    conversations = [record.pop("conversation") for record in records]
    if replay is None:  # a replay's are the recording's
        write_conversations(Path(args.out) / f"{system.name}.conversations.jsonl.gz", conversations)
    build = {"llama_cpp_build": llama_server.llama_cpp_build()} if system.llama_cpp else {}
    engine = engine_figures(records, log) if system.clover else {}
    return {"system": system.name, "describe": system.describe, **build, "tools_as_text": as_text, "tasks": records,
            "peak_rss_mib": peak,
            "summary": {**summarize(records, peak), **engine, "draft_memory_tokens": memory,
                        "prefix_cache_mib": prefix_cache}}


def write_conversations(path: Path, conversations: list[dict[str, Any]]) -> None:
    """One JSON line per task (`id`, `conversation`, `requests`), gzipped: the messages alone, not the tools
    (the task's turns give them again)."""
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(c) + "\n" for c in conversations)


def read_conversations(path: Path) -> dict[str, dict[str, Any]]:
    """A conversations file (`write_conversations`, gzipped or not) as task id -> its line."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"--replay {path}: not a conversations file bench_agent.py wrote ({exc})") from exc
    if not lines or not all(isinstance(line, dict) and {"id", "conversation", "requests"} <= set(line)
                            for line in lines):
        raise SystemExit(f"--replay {path}: no task conversations in it (each line needs id, conversation, requests)")
    return {line["id"]: line for line in lines}


def draft_memory_tokens(metrics: str) -> int | None:
    found = re.search(r"^clover_draft_memory_tokens (\S+)$", metrics, re.M)
    return int(float(found.group(1))) if found else None


def prefix_cache_mib(metrics: str) -> float | None:
    """What the prefix cache holds after the run (MiB): the part of the peak that its budget bounds."""
    found = re.search(r"^clover_prefix_cache_bytes (\S+)$", metrics, re.M)
    return float(found.group(1)) / 2**20 if found else None


def engine_figures(records: list[dict[str, Any]], log_path: Path) -> dict[str, Any]:
    """From the server's request log (its first line: the warm-up request): tokens per forward over every request
    and over the later requests of each task (its first request's answer is the only one with no earlier turn of
    its own), and a digest of each answer's token ids, to compare systems that must write the same. None where the
    log does not hold one line per request (a request cut off by its timeout is not logged)."""
    from replay_drafts import measured, read_log  # here: it imports the engine (torch), which llama.cpp runs skip

    steps = [len(r["steps"]) for r in records]
    answers = read_log([log_path])[1:]
    if len(answers) != sum(steps):
        return {"tokens_per_forward": None, "tokens_per_forward_later": None, "answer_digests": None}
    later, at = [], 0
    for n in steps:
        later += answers[at + 1:at + n]
        at += n

    return {"tokens_per_forward": measured(answers)["tokens_per_forward"],
            "tokens_per_forward_later": measured(later)["tokens_per_forward"],
            "answer_digests": [hashlib.sha1(json.dumps(line["answer"]).encode()).hexdigest()[:16] for line in answers]}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(records: list[dict[str, Any]], peak_rss_mib: float | None) -> dict[str, Any]:
    """The per-system figures from the task records (module docstring)."""
    steps = [s for r in records for s in r["steps"]]
    first = [r["steps"][0]["ttft_s"] for r in records if r["steps"]]
    later = [s["ttft_s"] for r in records for s in r["steps"][1:]]
    decode = [(s["later_tokens"], s["total_s"] - s["ttft_s"]) for s in steps if s["later_tokens"] > 0]
    reported = [s for s in steps if s["cached_tokens"] is not None and s["prompt_tokens"] is not None]
    return {
        "tasks": len(records), "passed": sum(r["passed"] for r in records),
        "accuracy": sum(r["passed"] for r in records) / len(records) if records else None,
        "requests": len(steps), "tool_calls": sum(s["calls"] for s in steps),
        "valid_tool_calls": sum(s["valid_calls"] for s in steps),
        "task_time_s": sum(r["wall_s"] for r in records),
        "ttft_first_s": _median(first), "ttft_later_s": _median(later),
        "decode_tokens_per_s": (sum(n for n, _ in decode) / sum(t for _, t in decode)
                                if decode and sum(t for _, t in decode) > 0 else None),
        "completion_tokens": sum(s["completion_tokens"] for s in steps),
        "prompt_tokens": sum(s["prompt_tokens"] for s in reported) if reported else None,
        "cached_tokens": sum(s["cached_tokens"] for s in reported) if reported else None,
        "peak_rss_mib": peak_rss_mib,
    }


# -- report ------------------------------------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def same_answers(results: list[dict[str, Any]]) -> list[str]:
    """Lines saying how many answers of each other Clover system are token for token the first one's (requests
    in the same order: the agent's path is the same while the answers are)."""
    recorded = [r for r in results if r["summary"].get("answer_digests")]
    if len(recorded) < 2:
        return []
    first, lines = recorded[0], []
    for other in recorded[1:]:
        a, b = first["summary"]["answer_digests"], other["summary"]["answer_digests"]
        lines.append(f"Answers of `{other['system']}` token for token `{first['system']}`'s: "
                     f"{sum(x == y for x, y in zip(a, b))} of {max(len(a), len(b))}.")
    return lines


SAME_WORK = 0.02  # prompt-token totals further apart than this: the systems did not serve the same prompts


def against_llama_server(results: list[dict[str, Any]]) -> list[str]:
    """Each Clover system's peak resident memory and task time as multiples of each llama.cpp server's (the
    anchors: `llamacpp-server`, `llamacpp-server-ngram`, ...), measured in the same run. Task time over the tasks
    both finished (a time budget may stop one system earlier). No ratio where the two read prompt-token totals
    more than `SAME_WORK` apart over those tasks (then what differs is said instead)."""
    def finished(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {t["id"]: t for t in result["tasks"] if t.get("error") != "time budget"}

    def prompt_tokens(tasks: list[dict[str, Any]]) -> int:
        return sum(s["prompt_tokens"] or 0 for t in tasks for s in t["steps"])

    lines = []
    for anchor in (r for r in results if r["system"].startswith("llamacpp-server")):
        if not anchor["summary"]["peak_rss_mib"]:
            continue
        for r in results:
            if r["system"].startswith("llamacpp-server") or not r["summary"]["peak_rss_mib"]:
                continue
            a, b = finished(anchor), finished(r)
            common = [i for i in b if i in a]
            if not common:
                continue
            mine, theirs = [b[i] for i in common], [a[i] for i in common]
            tokens_a, tokens_b = prompt_tokens(theirs), prompt_tokens(mine)
            if tokens_a and tokens_b and abs(tokens_b - tokens_a) > SAME_WORK * tokens_a:
                lines.append(f"`{r['system']}` against `{anchor['system']}`: no ratio, the prompts differ "
                             f"({tokens_b} against {tokens_a} prompt tokens).")
                continue
            time_a, time_b = sum(t["wall_s"] for t in theirs), sum(t["wall_s"] for t in mine)
            lines.append(f"`{r['system']}` against `{anchor['system']}`: peak RSS "
                         f"{r['summary']['peak_rss_mib'] / anchor['summary']['peak_rss_mib']:.2f}x, task time "
                         f"{time_b / time_a:.2f}x ({time_b:.1f} s against {time_a:.1f} s over {len(common)} task"
                         f"{'s' * (len(common) != 1)}).")
    return lines


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# bench_agent: {meta['category']}, {meta['tasks']} tasks", "",
             f"Command: `{meta['command']}`  ", f"Machine: {meta['machine']}", "",
             "| system | passed | tool calls valid / written | requests | task time (s) | TTFT first (s) | "
             "TTFT later (s) | decode tok/s | TPF later | cached / prompt tokens | drafting memory (tokens) | "
             "prefix cache (MiB) | peak RSS (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        s = r["summary"]
        cached = "n/a" if s["cached_tokens"] is None else f"{s['cached_tokens']} / {s['prompt_tokens']}"
        passed = "not scored" if meta.get("replay") else f"{s['passed']} / {s['tasks']}"
        lines.append(f"| {r['describe']} | {passed} | {s['valid_tool_calls']} / {s['tool_calls']} "
                     f"| {s['requests']} | {s['task_time_s']:.1f} | {_fmt(s['ttft_first_s'])} | "
                     f"{_fmt(s['ttft_later_s'])} | {_fmt(s['decode_tokens_per_s'], '.1f')} | "
                     f"{_fmt(s.get('tokens_per_forward_later'))} | {cached} | {_fmt(s.get('draft_memory_tokens'), 'd')} "
                     f"| {_fmt(s.get('prefix_cache_mib'), '.0f')} | {_fmt(s['peak_rss_mib'], '.0f')} |")
    builds = sorted({(r["llama_cpp_build"]["llama_cpp"], r["llama_cpp_build"]["xllamacpp"])
                     for r in results if "llama_cpp_build" in r})
    lines += ["", "TTFT: medians, streamed (first: each task's first request, its whole prompt cold; later: every "
              "other request). Per-task results: the JSON beside this file."]
    if meta.get("replay"):
        lines += [f"Replayed: every system sent the requests recorded in `{meta['replay']}`, the same prompts; its "
                  "answers were timed, not fed back, and not scored."]
    lines += [f"llama.cpp: {build} (xllamacpp {version})." for build, version in builds]
    lines += against_llama_server(results)
    lines += same_answers(results)
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["system"] for r in results]
    panels = [("task accuracy", "accuracy"), ("TTFT first request (s)", "ttft_first_s"),
              ("TTFT later requests (s)", "ttft_later_s"), ("decode tokens/s", "decode_tokens_per_s"),
              ("peak RSS (MiB)", "peak_rss_mib")]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2))
    for ax, (title, key) in zip(axes, panels):
        ax.bar(names, [r["summary"][key] or 0 for r in results], color="tab:green")
        if key == "accuracy":
            ax.set_ylim(0, 1)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", default=["clover", "llamacpp-server"], choices=list(SYSTEMS))
    p.add_argument("--category", default="multi_turn_base", help="a BFCL multi-turn category")
    p.add_argument("--tasks", type=int, default=2, help="the first N tasks of the category")
    p.add_argument("--max-steps", type=int, default=BFCL_MAX_STEPS, help="requests per user turn (BFCL: 20)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer")
    p.add_argument("--threads", type=int, default=1, help="server threads")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--budget-s", type=float, default=1800.0,
                   help="total time for the tasks, shared equally by the systems (server start-up not counted)")
    p.add_argument("--model", help="clover serve --model (default: clover-smol)")
    p.add_argument("--gguf", help="the llama.cpp systems' model (default: clover-smol's export at --gguf-quant)")
    p.add_argument("--gguf-quant", choices=("q4_0", "q8_0"), default="q8_0",
                   help="which export of clover-smol the llama.cpp systems read (llama-server's and clover-llamacpp's)")
    p.add_argument("--ctx", type=int, default=8192, help="llama-server's context (clover-smol's: 8192)")
    p.add_argument("--replay", type=Path, default=None,
                   help="a conversations file an earlier run wrote (OUT/<system>.conversations.jsonl.gz): send its "
                        "requests again, the same prompts to every system (answers timed, not fed back, not scored)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_agent"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM as an exception, so that the servers' `finally` stops them as on Ctrl-C
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = load_tasks(args.category, args.tasks)
    replay = None
    if args.replay:
        replay = read_conversations(args.replay)
        missing = [t.id for t in tasks if t.id not in replay]
        if missing:
            raise SystemExit(f"--replay {args.replay} has no conversation for {len(missing)} of the {len(tasks)} "
                             f"tasks asked for (first: {missing[0]}): ask for fewer --tasks")
    meta = {"category": args.category, "tasks": len(tasks), "machine": machine(),
            "command": "python benchmarks/bench_agent.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "replay": str(args.replay) if args.replay else None}
    results = []
    for name in args.systems:
        print(f"{name}: {SYSTEMS[name].describe}", flush=True)
        results.append(run_system(SYSTEMS[name], tasks, args, args.budget_s / len(args.systems), replay))
        (out / "bench_agent.json").write_text(json.dumps({**meta, "results": results}, indent=1))
    (out / "bench_agent.md").write_text(markdown(results, meta))
    plot(results, out / "bench_agent.png")
    print(markdown(results, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
