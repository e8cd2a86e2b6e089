"""instructor on the server (`instructor.from_openai` over the official client with a base URL): a pydantic model
created in each mode that constrains the answer (TOOLS, TOOLS_STRICT: a forced call of the model's function;
JSON_SCHEMA: `response_format` with its schema), and JSON mode, which asks for any JSON object.

The model writes nonsense; the server guarantees a schema-valid call or answer, so instructor's one attempt (no
retry allowed) parses, greedy. JSON mode gives the schema in the prompt only (the server holds the answer to a JSON
object, as OpenAI's API does): a model that reads it answers the model's fields; this random model does not, so
what is asserted there is the server's side: a JSON object, which instructor parses and hands to validation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import instructor
import openai
import pytest
from instructor.core.exceptions import IncompleteOutputException, InstructorRetryException
from pydantic import BaseModel, ValidationError

from server_helpers import concise_server

NAME = "clover-instructor"
MAX_TOKENS = 200
MESSAGES = [{"role": "user", "content": "Extract: Ada Lovelace, 36, mathematician."}]


class Person(BaseModel):  # outside decision mode's form subset: the grammar path
    name: str
    age: int
    job: str


class Verdict(BaseModel):  # inside it: decision mode under JSON_SCHEMA
    kind: Literal["person", "place"]
    ok: bool


@pytest.fixture(scope="module")
def client(chat_tokenizer) -> Iterator[openai.OpenAI]:
    with concise_server(chat_tokenizer, NAME) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("schema", [Person, Verdict])
@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.TOOLS_STRICT, instructor.Mode.JSON_SCHEMA])
def test_constrained_modes_create_the_model_on_the_first_attempt(client, mode, schema):
    out = instructor.from_openai(client, mode=mode).chat.completions.create(
        model=NAME, response_model=schema, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0, max_retries=0)
    assert isinstance(out, schema)


def test_json_mode_gets_a_json_object_that_instructor_validates(client):
    """Sampled: greedy decoding of this model nests objects past any budget (a cut answer is instructor's
    `IncompleteOutputException`); the first answer that ends is a JSON object, which fails validation only for its
    keys."""
    patched = instructor.from_openai(client, mode=instructor.Mode.JSON)
    for seed in range(12):
        try:
            patched.chat.completions.create(model=NAME, response_model=Person, messages=MESSAGES,
                                            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, max_retries=0)
        except IncompleteOutputException:
            continue
        except InstructorRetryException as exc:
            assert isinstance(exc.__cause__, ValidationError), exc
            answer = exc.last_completion.choices[0]
            assert answer.finish_reason == "stop" and isinstance(json.loads(answer.message.content), dict)
            return
    pytest.fail("no sampled answer ended within the token budget")
