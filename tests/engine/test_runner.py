"""The engine's runner interface (`clover.engine.runner`): it runs any module with Clover's forward signature as it
is, `prompt` reaching the module's forward as its keyword (the engine imports no model), and the model's forward
hands that keyword to its layers (what they read: `clover.model.prompt_rows`), never to its LM head."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import clover
from clover.engine import generate
from clover.engine.runner import ModuleRunner, as_runner
from clover.model import CloverForBlockDiffusion, prompt_rows
from clover.runners.torch_runner import TorchRunner
from model_helpers import PROMPTS, tiny_model


class Recording(torch.nn.Module):
    """A module with Clover's forward signature that is no Clover model: it runs one and keeps the `prompt` flags."""

    def __init__(self, model: CloverForBlockDiffusion) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config
        self.prompts: list[bool] = []

    def new_cache(self, batch_size: int) -> Any:
        return self.inner.new_cache(batch_size)

    def forward(self, ids: torch.Tensor | None, block_size: int = 1, *, prompt: bool = False, **kwargs: Any) -> Any:
        self.prompts.append(prompt)
        return self.inner(ids, block_size, prompt=prompt, **kwargs)


@pytest.mark.parametrize("block_size", [1, 4])
def test_the_engine_runs_any_module_with_the_forward_signature(block_size: int) -> None:
    model = tiny_model("clover-tiny-dense")
    recording = Recording(model)
    got = generate(recording, PROMPTS, max_new_tokens=10, block_size=block_size, threshold=0.5)
    want = generate(model, PROMPTS, max_new_tokens=10, block_size=block_size, threshold=0.5)
    assert got.sequences == want.sequences
    assert recording.prompts[0] and not recording.prompts[-1]  # the prefill reads the prompt; the last step does not


def test_a_module_gets_the_module_runner_and_a_runner_is_kept() -> None:
    model = tiny_model("clover-tiny-dense")
    runner = as_runner(model)
    assert type(runner) is ModuleRunner and runner.name == "torch" and runner.model is model
    opened = TorchRunner(model)
    assert as_runner(opened) is opened
    with pytest.raises(TypeError, match="expected a Clover model .* got str"):
        as_runner("model")


def test_model_generate_is_the_engines_on_both_names() -> None:  # the facade's class is the model package's
    model = tiny_model("clover-tiny-dense")
    assert clover.CloverForBlockDiffusion is CloverForBlockDiffusion
    want = generate(model, [PROMPTS[0]], max_new_tokens=8, block_size=4, threshold=0.5).sequences
    assert clover.CloverForBlockDiffusion.generate(model, [PROMPTS[0]], 8, block_size=4, threshold=0.5).sequences \
        == want


@pytest.mark.parametrize("prompt", [False, True])
def test_the_forwards_prompt_keyword_reaches_the_layers_not_the_head(prompt: bool) -> None:
    model = tiny_model("clover-tiny-dense")
    seen: dict[str, list[bool]] = {"layer": [], "head": []}
    model.model.layers[0].register_forward_hook(lambda *_: seen["layer"].append(prompt_rows.is_reading_prompt()))
    model.lm_head.register_forward_hook(lambda *_: seen["head"].append(prompt_rows.is_reading_prompt()))
    ModuleRunner(model).forward(torch.tensor([PROMPTS[0]]), 1, cache=model.new_cache(1), prompt=prompt)
    assert seen == {"layer": [prompt], "head": [False]}
    assert not prompt_rows.is_reading_prompt()  # the flag ends with the forward
