"""Hermes calls: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, a JSON object per block (Clover's
own template, Qwen2.5, Qwen3, Hermes 2 / 3).

The arguments stream as the raw JSON text the model writes (`JsonCall`), from their opening brace to their closing
one: what follows inside the block (the object's `}`) does not change the call.
"""

from __future__ import annotations

from typing import Any

from clover.tool_formats.call_parser import JsonCall


class HermesParser(JsonCall):
    """The inside of one `<tool_call>` block."""

    def __init__(self, schemas: dict[str, Any] | None = None, first_index: int = 0) -> None:
        super().__init__(("arguments",), schemas, first_index)
