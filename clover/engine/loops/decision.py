"""Decision decoding: fill every slot of a form at once, most confident first (docs/decision.md).

The form (`clover.engine.constraints.form`) is rendered as the JSON answer with masked slots, after the prompt:

    prompt | {"category": [s s s] , "urgency": [s s] , "needs_human": [s] , "summary": "[t t t t t t] } EOS [MASK]...

A choice slot is as long as its longest value's tokens (`' "billing"'`, `' true'`, `' 3'`); shorter values are
padded with the tokenizer's single-space token (JSON allows whitespace after a value, so the padded text is still
the JSON answer). The whole answer is ONE query block against the prompt's cache: every slot sees every other
slot and the fixed text around them in both directions. One step is one forward; then

* **choice slots** are scored as a whole: value `v` (padded to the slot's `L` tokens) gets
  `log P(v) = sum_l log p_l(v_l)`, where `p_l` is the model's prediction for slot position `l` in that forward —
  all of the slot's positions predicted in parallel from the masked slot (token shift: position `l` is read from
  the output one to its left). This is the mean-field approximation of the value's probability given the rest
  of the form as it stands; it costs one gather per slot and no extra forward. Values are renormalised over the
  allowed ones: the slot's confidence is `max_v softmax(log P)(v)`.
* **free-text slots** run the block rule inside the slot: each masked position's candidate is the argmax over
  the tokens it may hold (no mask, special or out-of-vocabulary ids), its confidence that token's probability.
  The first token containing `"` ends the text (the closing quote); the slot's later positions become padding.
* every unit (an undecided choice slot, a masked text position) whose confidence is `>= threshold` is
  committed, and always the single most confident one; committed tokens are written into the block, and the next
  forward re-predicts the rest seeing them. So a form takes at most (choice slots + text tokens) forwards, and
  fewer when the model is confident about several slots at once.

`decide_autoregressive` fills the same layout the way an AR model does constrained decoding (block size 1,
causal): field by field in order, token by token, each token the most probable among those that continue an
allowed value (a token forced by the allowed values costs no forward; it rides in the next forward), free text
token by token. It is the baseline of the example in `examples/triage/`.

Batches (`decide_batch`): contexts of one form are left-padded into one prefill (`clover.engine.prefill`, as for
generation) and stepped in lockstep by a `DecisionRun`, one forward per `step`; a row whose form is complete
leaves the batch (`cache.select`), and each row gets what it gets alone. Greedy only.

Every forward goes through the model-runner interface (`clover.engine.runner`), so decisions run on any runner:
the torch model, or a GGUF on llama.cpp (`clover.runners.llamacpp`), where the answer block is one query block.
"""

from __future__ import annotations

import json
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from clover.chat_template import render_chat
from clover.config import check_threshold
from clover.engine.constraints.form import Field, Form, parse_form, value_text
from clover.engine.prefill import DEFAULT_PREFILL_CHUNK, prefill
from clover.engine.runner import ModelRunner, as_runner, release_cache

Context = str | Sequence[dict[str, Any]]
Decode = Callable[[list[int]], str]  # token ids -> text, special tokens skipped
INSTRUCTION = "Fill in this form as a JSON object with exactly these fields and allowed values: "


@dataclass
class Decision:
    """A filled form: `values` (valid against the schema), each field's probability, and what it cost."""

    values: dict[str, Any]
    probabilities: dict[str, float]
    forward_passes: int
    order: list[list[str]] = field(default_factory=list)  # fields completed at each step (AR: one per step)
    wall_time_s: float = 0.0
    prompt_tokens: int = 0
    answer_tokens: int = 0  # the answer's tokens: the form's text and its slots

    def to_json(self) -> dict[str, Any]:
        return {"values": self.values, "probabilities": self.probabilities, "forward_passes": self.forward_passes}


@dataclass
class Layout:
    """A form rendered for one tokenizer: the answer block with masked slots, and where each slot is."""

    form: Form
    ids: list[int]  # the query block: answer with mask ids in the slots, EOS, mask padding
    slots: list[tuple[int, int]]  # (start, length) of each field's slot in `ids`
    choice_ids: list[torch.Tensor | None]  # per field: [values, L] token ids of each padded value (None: text)
    pad_id: int
    mask_id: int
    answer_len: int  # tokens before the mask padding: the answer and its EOS

    def fill(self, values: dict[str, Any], tokenize: Any) -> list[int]:
        """The answer block with `values` written into the slots (training targets; `tokenize`: text -> ids).
        Free text is tokenized, closed with `"` and padded; it must fit its slot."""
        ids = list(self.ids)
        for f, (start, length), table in zip(self.form.fields, self.slots, self.choice_ids):
            if table is None:
                tokens = tokenize(json.dumps(values[f.name])[1:])  # text + closing quote, JSON-escaped
                if len(tokens) > length:
                    raise ValueError(f"{f.name}: {values[f.name]!r} takes {len(tokens)} tokens, the slot {length}")
                tokens += [self.pad_id] * (length - len(tokens))
            else:
                tokens = table[f.choices.index(values[f.name])].tolist()
            ids[start:start + length] = tokens
        return ids


def _tokenize(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_layout(form: Form, tokenizer: Any, config: Any) -> Layout:
    """The answer block of `form` for `tokenizer` and the model's `config` (mask id, block size)."""
    mask_id = config.mask_token_id
    if mask_id is None:
        raise ValueError("the model's config has no mask_token_id; decision decoding needs one")
    pad = _tokenize(tokenizer, " ")
    if len(pad) != 1:
        raise ValueError(f"the tokenizer encodes ' ' as {len(pad)} tokens; decision slots are padded with one")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_ids[0]
    ids: list[int] = []
    slots, tables = [], []
    for i, f in enumerate(form.fields):
        ids += _tokenize(tokenizer, ("{" if i == 0 else ", ") + json.dumps(f.name) + ":" + (' "' if f.is_text else ""))
        if f.is_text:
            length, table = f.max_tokens, None
        else:
            values = [_tokenize(tokenizer, " " + value_text(v)) for v in f.choices]
            length = max(len(v) for v in values)
            table = torch.tensor([v + [pad[0]] * (length - len(v)) for v in values], dtype=torch.long)
            if len({tuple(r) for r in table.tolist()}) != len(values):
                raise ValueError(f"{f.name}: two allowed values have the same tokens")
        slots.append((len(ids), length))
        tables.append(table)
        ids += [mask_id] * length
    ids += _tokenize(tokenizer, "}") + [eos]
    answer_len = len(ids)
    ids += [mask_id] * max(0, config.block_size - len(ids))  # as in training: a response block padded with masks
    return Layout(form, ids, slots, tables, pad[0], mask_id, answer_len)


def render_prompt(tokenizer: Any, context: Context, schema: Form | dict[str, Any]) -> list[int]:
    """The prompt ids: with a chat template, a system turn carrying the schema (a form's, or any JSON Schema: what
    `clover decide` puts before a grammar-constrained answer) then the context as a user turn (or the given
    messages); without one, the context text and a newline (a model trained on its forms)."""
    if isinstance(context, str):
        if not context:
            raise ValueError("the context is empty")
        if not getattr(tokenizer, "chat_template", None):
            return _tokenize(tokenizer, context + "\n")
        messages: list[dict[str, Any]] = [{"role": "user", "content": context}]
    else:
        messages = [dict(m) for m in context]
        if not messages:
            raise ValueError("the context has no messages")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat messages need a tokenizer with a chat template")
    system = {"role": "system", "content": INSTRUCTION + json.dumps(schema.schema if isinstance(schema, Form)
                                                                   else schema)}
    return _tokenize(tokenizer, render_chat(tokenizer, [system, *messages], add_generation_prompt=True))


_QUOTES: "weakref.WeakKeyDictionary[Any, tuple[torch.Tensor, torch.Tensor]]" = weakref.WeakKeyDictionary()


def _token_classes(tokenizer: Any, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[vocab]` bools: tokens that contain `"` (end a text slot), tokens a text slot may not hold (special
    tokens, ids the tokenizer cannot decode). Computed once per tokenizer."""
    if tokenizer in _QUOTES and _QUOTES[tokenizer][0].numel() == vocab:
        return _QUOTES[tokenizer]
    n = min(len(tokenizer), vocab)
    texts = tokenizer.batch_decode([[i] for i in range(n)])
    quote = torch.zeros(vocab, dtype=torch.bool)
    quote[:n] = torch.tensor(['"' in t for t in texts])
    banned = torch.ones(vocab, dtype=torch.bool)
    banned[:n] = False
    banned[[i for i in tokenizer.all_special_ids if i < vocab]] = True
    _QUOTES[tokenizer] = (quote, banned)
    return quote, banned


def _decoder(tokenizer: Any) -> Decode:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _text_value(decode: Decode, f: Field, tokens: list[int], quote: torch.Tensor) -> tuple[str, int]:
    """The text a slot's tokens spell (up to the closing quote, cut to `maxLength`), and how many tokens it used
    (the closing one included)."""
    end = next((i for i, t in enumerate(tokens) if quote[t]), None)
    used = len(tokens) if end is None else end + 1
    text = decode(tokens[:used])
    if end is not None:
        text = text[:text.find('"')] if '"' in text else text
    return text.strip()[:f.max_chars], used


# -- decision mode ------------------------------------------------------------------------------------------------
def decide(model: torch.nn.Module | ModelRunner, tokenizer: Any, context: Context, schema: dict[str, Any] | Form, *,
           threshold: float = 0.9) -> Decision:
    """Fill `schema`'s form for one `context` (text, or chat messages) by decision decoding, on a Clover model or
    any model runner (`clover.engine.runner`)."""
    return decide_batch(model, tokenizer, [context], schema, threshold=threshold)[0]


def decide_batch(model: torch.nn.Module | ModelRunner, tokenizer: Any, contexts: Sequence[Context],
                 schema: dict[str, Any] | Form, *, threshold: float = 0.9,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> list[Decision]:
    """Fill the same form for each context; lockstep batch, each row as it would be alone."""
    run = DecisionRun.create(as_runner(model), tokenizer, contexts, schema, threshold=threshold,
                             prefill_chunk=prefill_chunk)
    while not run.step():
        pass
    return run.results()


class DecisionRun:
    """Contexts filling one form in lockstep, one forward per `step`: `decide_batch` steps it to the end; the
    server's scheduler queues it with its generation requests (first come, first served) and steps it beside their
    batches, one step an iteration (the `Run` interface: `step` until done, then `results`), on the thread that
    owns the runner."""

    def __init__(self, runner: ModelRunner, tokenizer: Any, layout: Layout, prompts: list[list[int]],
                 threshold: float, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, decode: Decode | None = None) -> None:
        self.runner, self.layout, self.threshold = runner, layout, threshold
        self.prompts, self.prefill_chunk = prompts, prefill_chunk
        self.decode = decode or _decoder(tokenizer)  # the server's goes through its tokenizer's lock
        self.device = runner.device
        self.quote, banned = _token_classes(tokenizer, runner.config.vocab_size)
        banned = banned.clone()
        banned[layout.mask_id] = True
        self.text_banned = banned  # applied to logits on the CPU
        # logits are needed at the output left of every slot position (token shift), or at the position itself
        # for a model without the shift (`token_shift` false)
        self.slot_pos = [torch.arange(s, s + n) for s, n in layout.slots]
        self.read_at = torch.cat(self.slot_pos) - int(runner.config.token_shift)
        # a model that reads prompts on its block grid (`prompt_reading` "blocks") gets them so
        self.grid = runner.config.block_size if runner.config.prompt_reading == "blocks" else 1
        self.offsets = [0]
        for s in self.slot_pos:
            self.offsets.append(self.offsets[-1] + len(s))
        n, fields = len(prompts), layout.form.fields
        self.start = time.perf_counter()
        self.block = torch.tensor(layout.ids, dtype=torch.long).repeat(n, 1)
        self.decided = torch.zeros(n, len(fields), dtype=torch.bool)
        self.logp = torch.zeros(n, len(fields))  # log-probability of each decided field's value
        self.text_lp = torch.zeros(n, len(layout.ids))  # per text position: log-prob of the token committed there
        self.rows = list(range(n))  # original row of each row still in the batch
        self.done: list[Decision | None] = [None] * n
        self.forwards = [0] * n
        self.order: list[list[list[str]]] = [[] for _ in range(n)]
        self.cache: Any = None  # made by the first step (the prefill), dropped when every row is decided

    @classmethod
    def create(cls, runner: ModelRunner, tokenizer: Any, contexts: Sequence[Context], schema: dict[str, Any] | Form,
               *, threshold: float = 0.9, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
               decode: Decode | None = None) -> DecisionRun:
        """Validate and render: the form, its layout for this tokenizer and runner, each context's prompt.
        `decode`: how the finished text slots are detokenized (default: the tokenizer's `decode`)."""
        check_threshold(threshold)
        if len(contexts) == 0:
            raise ValueError("contexts is empty")
        form = parse_form(schema)
        layout = render_layout(form, tokenizer, runner.config)
        prompts = [render_prompt(tokenizer, c, form) for c in contexts]
        return cls(runner, tokenizer, layout, prompts, threshold, prefill_chunk, decode)

    def step(self) -> bool:
        """One forward of the answer block (the first also prefills the prompts), then every row's commits;
        rows whose form is complete leave the batch. True when every row is decided."""
        if not self.rows:
            raise RuntimeError("every row is decided: there is no step left")
        with torch.inference_mode():
            logits = self._forward().float().cpu()
        done_now = []
        for k, r in enumerate(self.rows):
            self.forwards[r] += 1
            self.order[r].append(self._step(logits[k], self.block[r], self.decided[r], self.logp[r], self.text_lp[r]))
            if bool(self.decided[r].all()):
                self.done[r] = self._result(r)
                done_now.append(k)
        if done_now:
            keep = [k for k in range(len(self.rows)) if k not in done_now]
            self.rows = [self.rows[k] for k in keep]
            if self.rows:
                self.cache.select(keep)
            else:
                release_cache(self.cache)  # its rows go back to the runner now (llama.cpp: its slots)
                self.cache = None
        return not self.rows

    def results(self) -> list[Decision]:
        if self.rows:
            raise RuntimeError(f"{len(self.rows)} rows are still deciding: step until step() returns True")
        return self.done  # type: ignore[return-value]

    def _forward(self) -> torch.Tensor:
        """One forward of the answer block against the cache: logits at `read_at`, `[N, positions, V]`. The first
        prefills the prompts (`clover.engine.prefill`) and carries their last chunk as clean tokens."""
        query = self.block[self.rows].to(self.device)
        n, a = query.shape
        clean, kwargs = None, {}
        if not any(self.forwards):  # the first step
            self.cache = self.runner.new_cache(n)
            size = a if self.grid == 1 else self.grid
            last = prefill(self.prompts, self.layout.mask_id, self.prefill_chunk,
                           lambda ids, **kw: self.runner.forward(ids, size, cache=self.cache, **kw), self.device,
                           self.grid)
            clean, kwargs = last.ids, last.kwargs  # chunks before it are prefill, not steps (as in generation)
            if self.grid > 1:  # the answer block is longer than the grid's blocks: the last chunk goes alone
                self.runner.forward(clean, self.grid, cache=self.cache, logits_to_keep=0, prompt=True, **kwargs)
                clean, kwargs = None, {}
        t = 0 if clean is None else clean.shape[1]
        at = torch.zeros(n, t + a, dtype=torch.bool, device=self.device)
        at[:, t + self.read_at.to(self.device)] = True
        # the first step carries the prompt's last chunk
        out = self.runner.forward(clean, a, cache=self.cache, query_ids=query, logits_at=at, prompt=t > 0, **kwargs)
        return out.view(n, len(self.read_at), -1)

    def _step(self, logits: torch.Tensor, block: torch.Tensor, decided: torch.Tensor, logp: torch.Tensor,
              text_lp: torch.Tensor) -> list[str]:
        """Commit this step's units of one row in place; returns the fields it completed."""
        lp = torch.log_softmax(logits, dim=-1)  # [positions, V]
        units: list[tuple[float, int, int, int, float]] = []  # (confidence, field, position or -1, token, logp)
        for i, (f, table) in enumerate(zip(self.layout.form.fields, self.layout.choice_ids)):
            if decided[i]:
                continue
            part = lp[self.offsets[i]:self.offsets[i + 1]]  # [L, V]
            if table is not None:
                score = part.gather(1, table.T).sum(0)  # [values]: sum_l log p_l(v_l)
                probs = torch.softmax(score, dim=0)
                conf, best = probs.max(0)
                units.append((float(conf), i, -1, int(best), float(torch.log(conf))))
                continue
            start = int(self.slot_pos[i][0])
            masked = block[start:start + len(part)] == self.layout.mask_id
            part = part.masked_fill(self.text_banned, float("-inf"))
            best_lp, best = part.max(1)
            for j in torch.nonzero(masked).flatten().tolist():
                units.append((math.exp(float(best_lp[j])), i, start + j, int(best[j]), float(best_lp[j])))
        accepted = [u for u in units if u[0] >= self.threshold] or [max(units, key=lambda u: u[0])]
        completed = []
        for conf, i, pos, token, unit_lp in accepted:
            if pos < 0:
                start, length = self.layout.slots[i]
                block[start:start + length] = self.layout.choice_ids[i][token]
                decided[i], logp[i] = True, unit_lp
                completed.append(self.layout.form.fields[i].name)
            else:
                block[pos], text_lp[pos] = token, unit_lp
        for i, (start, length) in enumerate(self.layout.slots):  # text: a closing quote pads the rest
            if self.layout.choice_ids[i] is not None or decided[i]:
                continue
            slot = block[start:start + length]
            ends = torch.nonzero(self.quote[slot]).flatten()
            if len(ends):
                slot[int(ends[0]) + 1:] = self.layout.pad_id
            if not bool((slot == self.layout.mask_id).any()):
                decided[i] = True
                completed.append(self.layout.form.fields[i].name)
        return completed

    def _result(self, r: int) -> Decision:
        block, logp, text_lp = self.block[r], self.logp[r], self.text_lp[r]
        values, probs = {}, {}
        for i, (f, (s, length)) in enumerate(zip(self.layout.form.fields, self.layout.slots)):
            if f.is_text:
                values[f.name], used = _text_value(self.decode, f, block[s:s + length].tolist(), self.quote)
                probs[f.name] = math.exp(float(text_lp[s:s + used].sum()))
            else:
                values[f.name] = f.choices[_match(self.layout.choice_ids[i], block[s:s + length])]
                probs[f.name] = math.exp(float(logp[i]))
        return Decision(values, probs, self.forwards[r], self.order[r], time.perf_counter() - self.start,
                        len(self.prompts[r]), self.layout.answer_len)


def _match(table: torch.Tensor, tokens: torch.Tensor) -> int:
    return int(torch.nonzero((table == tokens[None]).all(1)).flatten()[0])


# -- the AR baseline --------------------------------------------------------------------------------------------
def decide_autoregressive(model: torch.nn.Module | ModelRunner, tokenizer: Any, context: Context,
                          schema: dict[str, Any] | Form) -> Decision:
    """Fill the same layout as an AR model does constrained decoding (block size 1): field by field, token by
    token, each token the most probable of those that continue an allowed value; forced tokens cost no forward."""
    runner = as_runner(model)
    if not runner.config.token_shift:
        raise ValueError(f"decide_autoregressive reads each token from the output at the one before it, which a model "
                         f"without the token shift (family {runner.config.family!r}) does not predict; use decide")
    form = parse_form(schema)
    layout = render_layout(form, tokenizer, runner.config)
    prompt = render_prompt(tokenizer, context, form)
    start = time.perf_counter()
    quote, banned = _token_classes(tokenizer, runner.config.vocab_size)
    banned = banned.clone()
    banned[layout.mask_id] = True
    cache = runner.new_cache(1)
    forwards, order = 0, []
    values, probs = {}, {}
    pending = prompt + layout.ids[:layout.slots[0][0]]

    def next_logp() -> torch.Tensor:
        """Write the pending tokens (causally) and read the distribution of the next one."""
        nonlocal forwards, pending
        ids = torch.tensor([pending], dtype=torch.long, device=runner.device)
        last = torch.zeros(1, len(pending), dtype=torch.bool, device=runner.device)
        last[0, -1] = True
        # the first forward writes the prompt
        logits = runner.forward(ids, 1, cache=cache, logits_at=last, prompt=forwards == 0)[0].float().cpu()
        forwards += 1
        pending = []
        return torch.log_softmax(logits, dim=-1)

    with torch.inference_mode():
        for i, (f, (s, length), table) in enumerate(zip(form.fields, layout.slots, layout.choice_ids)):
            total = 0.0
            if table is not None:
                alive = torch.ones(len(table), dtype=torch.bool)
                for j in range(length):
                    allowed = table[alive, j].unique()
                    token = int(allowed[0])
                    if len(allowed) > 1:  # a real choice: read the model, restricted to the allowed tokens
                        part = torch.log_softmax(next_logp()[allowed], dim=0)
                        k = int(part.argmax())
                        token, total = int(allowed[k]), total + float(part[k])
                    alive &= table[:, j] == token
                    pending.append(token)
                values[f.name] = f.choices[int(torch.nonzero(alive).flatten()[0])]
            else:
                tokens = []
                for j in range(length):
                    lp = next_logp().masked_fill(banned, float("-inf"))
                    token = int(lp.argmax())
                    total += float(lp[token])
                    tokens.append(token)
                    pending.append(token)
                    if quote[token]:
                        break
                pending += [layout.pad_id] * (length - len(tokens))
                values[f.name] = _text_value(_decoder(tokenizer), f, tokens, quote)[0]
            probs[f.name] = math.exp(total)
            order.append([f.name])
            end = layout.slots[i + 1][0] if i + 1 < len(layout.slots) else s + length
            pending += layout.ids[s + length:end]
    release_cache(cache)
    return Decision(values, probs, forwards, order, time.perf_counter() - start, len(prompt), layout.answer_len)
