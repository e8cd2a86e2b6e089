"""How a model family writes tool calls, chosen from its chat template: the parsers behind `tool_calls`.

    hermes       <tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>
                 Clover's own template, Qwen2.5, Qwen3, Hermes 2 / 3
    qwen3_coder  <tool_call>\\n<function=f>\\n<parameter=x>\\n1\\n</parameter>\\n</function>\\n</tool_call>
                 Qwen3-Coder, Qwen3.5 / 3.6 (the flagship's base), Qwen3-Next
    llama3_json  {"name": "f", "parameters": {"x": 1}}     (the whole answer; `<|python_tag|>` allowed first,
                 several calls separated by `;`) Llama 3.1 / 3.2 / 3.3

`detect` reads the template's own text for the tags it writes (vLLM and SGLang make the user pick a parser per
model; `clover serve --tool-call-parser` still overrides). Each format's parser is its own module behind one
interface (`call_parser.CallParser`): it streams a call as it is written (its name first, then its arguments' JSON text
in fragments), and the same parser fed the whole text gives the whole response's calls. The XML format carries
every value as text: each is converted to JSON by the type its tool's schema gives that parameter
(`qwen3_coder.typed_value`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clover.tool_formats.call_parser import CallDelta, CallParser, partial_tag
from clover.tool_formats.hermes import HermesParser
from clover.tool_formats.llama3_json import PYTHON_TAG, Llama3Parser
from clover.tool_formats.qwen3_coder import Qwen3CoderParser

CALL, END_CALL = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolFormat:
    """`wrapped`: calls sit in `<tool_call>` blocks among other text (a `parser()` reads a block's inside); else
    the whole answer is the call(s) (a `parser()` reads the answer). How a call is written, as the grammar of a
    forced call writes it: `start`, then `head` (`{name}`: the tool's name, JSON-quoted unless `xml`), the
    arguments (a JSON object, or `xml` parameter blocks), `tail`; calls separated by `separator`."""

    name: str
    start: str
    head: str
    tail: str
    separator: str
    parser_type: type[CallParser]
    xml: bool = False
    wrapped: bool = True

    def parser(self, schemas: dict[str, Any] | None = None, first_index: int = 0) -> CallParser:
        """A parser for the next call block (or the answer); `schemas`: tool name -> its `parameters`."""
        return self.parser_type(schemas, first_index)


HERMES = ToolFormat("hermes", CALL + "\n", '{{"name": {name}, "arguments": ', "}\n" + END_CALL, "\n", HermesParser)
QWEN3_CODER = ToolFormat("qwen3_coder", CALL + "\n", "<function={name}>\n", "</function>\n" + END_CALL, "\n",
                         Qwen3CoderParser, xml=True)
LLAMA3_JSON = ToolFormat("llama3_json", "", '{{"name": {name}, "parameters": ', "}", "; ", Llama3Parser, wrapped=False)
TOOL_FORMATS = {f.name: f for f in (HERMES, QWEN3_CODER, LLAMA3_JSON)}
__all__ = ["CALL", "END_CALL", "PYTHON_TAG", "TOOL_FORMATS", "HERMES", "LLAMA3_JSON", "QWEN3_CODER", "CallDelta",
           "CallParser", "ToolFormat", "detect", "partial_tag"]


def detect(template: str | None) -> ToolFormat:
    """The format a chat template writes its calls in (Hermes when it shows none)."""
    if not template:
        return HERMES
    if "<function=" in template and "<parameter=" in template:
        return QWEN3_CODER
    if CALL in template:
        return HERMES
    if PYTHON_TAG in template or ('"parameters"' in template and "ipython" in template):
        return LLAMA3_JSON
    return HERMES
