"""What every converter shares: the `Source` interface, HF directory reading, and the conversion driver.

A converter is a `Source`: a `CloverConfig` describing the AR model, a `tensor(name)` that returns the tensor
for a *Clover* state-dict name (doing whatever renaming, splitting or fusing its layout needs), and the
tokenizer. The driver (`run_conversion`) pulls tensors in the order of the Clover model's own state dict (built
on the meta device, so even the 35B needs no memory), which makes the model the single source of truth for
names and shapes; it then

* initialises Clover-only parameters to the values that make the model exactly its AR base
  (`CLOVER_ONLY_INIT`),
* places the mask token (`plan_mask_token`) and patches the embedding / LM head rows for it,
* casts to the requested dtype, checks every shape, and fails if any source tensor was left unused,
* streams the result into `clover.checkpoint.write_checkpoint`, which writes atomically: any failure above
  leaves no destination directory behind.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from clover.checkpoint import (LM_HEAD, checkpoint_tensor_shapes, format_names, safetensors_files,
                               write_checkpoint)
from clover.config import LLAMA3_ROPE_FIELDS, CloverConfig

logger = logging.getLogger(__name__)

EMBED = "model.embed_tokens.weight"
MASK_TOKEN = "<|mask|>"

# Clover-only parameters (no AR source has them) and the value that makes each an identity: with these, a
# converted model's `block_size=1` forward is exactly the AR reference's (docs/design.md §1).
CLOVER_ONLY_INIT: dict[str, Callable[[torch.Size, torch.dtype], torch.Tensor]] = {
    "linear_attn.conv1d_right.weight": lambda shape, dtype: torch.zeros(shape, dtype=dtype),  # no right context
    "linear_attn.memory_calibration": lambda shape, dtype: torch.zeros(shape, dtype=dtype),  # lambda(n) = 1
}


class SourceTensorError(ValueError):
    """A tensor the Clover model needs is missing from, or has the wrong shape in, the source checkpoint."""


# -- the Source interface ---------------------------------------------------------------------------------
class Source:
    """An AR checkpoint seen through Clover's names. Subclasses set `config` and implement `tensor`."""

    config: CloverConfig
    mask_token_id: int | None = None  # a block-diffusion checkpoint's own mask token (its row is kept as it is)

    def tensor(self, name: str) -> torch.Tensor:
        """The source tensor for Clover state-dict entry `name` (any dtype; the driver casts)."""
        raise NotImplementedError

    def unused_tensors(self) -> list[str]:
        """Source tensor names never read by `tensor()` (after the whole model was converted)."""
        return []

    def tokenizer(self) -> Any | None:
        """The source's tokenizer (a `PreTrainedTokenizerFast`), or None when it ships none."""
        return None

    def tokenizer_dir(self) -> Path | None:
        """A directory whose HF tokenizer files can be copied verbatim when the tokenizer is unchanged."""
        return None

    def close(self) -> None:
        pass

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SafetensorsReader:
    """Lazy, name-addressed access to the safetensors files of an HF directory, tracking what was read."""

    def __init__(self, directory: Path, ignore: Callable[[str], bool] = lambda name: False) -> None:
        self.directory = directory
        files = safetensors_files(directory)
        self._files = {name: path for name, path in files.items() if not ignore(name)}
        self._handles: dict[Path, Any] = {}
        self._used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str, *, wanted_by: str | None = None) -> torch.Tensor:
        if name not in self._files:
            for_ = f" (needed for Clover's {wanted_by!r})" if wanted_by and wanted_by != name else ""
            raise SourceTensorError(f"source tensor {name!r}{for_} not found in {self.directory}")
        self._used.add(name)
        return self._handle(name).get_tensor(name)

    def unused(self) -> list[str]:
        return sorted(set(self._files) - self._used)

    def _handle(self, name: str) -> Any:
        path = self._files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def close(self) -> None:
        self._handles.clear()


# -- HF config helpers -------------------------------------------------------------------------------------
def read_hf_dir(src: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(config.json, generation_config.json or {})` of an HF model directory."""
    if not src.is_dir():
        raise FileNotFoundError(f"source {src} is not a directory (an HF model directory is expected)")
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} has no config.json (an HF model directory is expected)")
    config = json.loads((src / "config.json").read_text())
    generation = src / "generation_config.json"
    return config, (json.loads(generation.read_text()) if generation.is_file() else {})


def rope_settings(hf_config: Any) -> dict[str, Any]:
    """CloverConfig's `rope_theta`, `partial_rotary_factor` and `rope_scaling` for a transformers config.

    transformers >= 5 standardises the legacy fields (top-level `rope_theta`, `partial_rotary_factor`,
    `rope_scaling`) into `rope_parameters`, filling what a file leaves out as its modelling code reads it (theta
    10000, `original_max_position_embeddings` = `max_position_embeddings`), so this reads only that. Clover
    computes plain RoPE and Llama 3's scaling (rope_type "llama3", every Llama 3.x checkpoint); any other type
    (linear, dynamic, yarn, longrope, ...) is refused by name. (Qwen3.5's multimodal `mrope_section` is plain
    RoPE for text: the three position streams are equal.)
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    kind = params.get("rope_type", "default")
    if kind not in ("default", "llama3"):
        raise ValueError(f"unsupported RoPE scaling: rope_type {kind!r} (config.json rope_scaling / rope_parameters "
                         f"{params}); Clover computes plain RoPE and rope_type 'llama3' only")
    if params.get("rope_theta") is None:
        raise ValueError("source config has no rope_theta")
    scaling = None
    if kind == "llama3":
        missing = [name for name in LLAMA3_ROPE_FIELDS if params.get(name) is None]
        if missing:
            raise ValueError(f"rope_type 'llama3' needs {missing} in config.json rope_scaling / rope_parameters")
        scaling = {"rope_type": "llama3", **{name: params[name] for name in LLAMA3_ROPE_FIELDS}}
    return {"rope_theta": float(params["rope_theta"]),
            "partial_rotary_factor": float(params.get("partial_rotary_factor", 1.0)), "rope_scaling": scaling}


def dense_mlp_layers(hf_config: Any) -> list[int]:
    """The layers a Qwen3-MoE / Qwen3-Next config gives a dense SwiGLU instead of experts, as their decoder layers
    decide: layer `i` is sparse iff `i not in mlp_only_layers`, `num_experts > 0` and `(i + 1) %
    decoder_sparse_step == 0` (published files: `mlp_only_layers` [], step 1, so every layer is sparse)."""
    return [i for i in range(hf_config.num_hidden_layers)
            if i in hf_config.mlp_only_layers or hf_config.num_experts <= 0
            or (i + 1) % hf_config.decoder_sparse_step != 0]


def special_token_ids(*configs: dict[str, Any]) -> dict[str, Any]:
    """bos / eos / pad ids: the first config (generation_config first) that sets each one wins."""
    out: dict[str, Any] = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        out[key] = next((c[key] for c in configs if c.get(key) is not None), None)
    return out


def require_silu(hf_config: Any) -> None:
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: Clover's SwiGLU uses silu")


def load_hf_tokenizer(src: Path) -> Any | None:
    """The tokenizer of an HF directory (from tokenizer.json when present), or None when it has none."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # deferred: transformers, only when a tokenizer is read

    if (src / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(src))
    if any((src / name).is_file() for name in ("tokenizer_config.json", "vocab.json", "tokenizer.model")):
        return AutoTokenizer.from_pretrained(str(src))
    logger.warning("%s has no tokenizer files; the checkpoint will have no tokenizer", src)
    return None


def fuse_experts(reader: SafetensorsReader, prefix: str, num_experts: int, which: str,
                 wanted_by: str) -> torch.Tensor:
    """Fuse per-expert weights `{prefix}.{e}.{gate,up,down}_proj.weight` into Clover's stacked tensors.

    `gate_up_proj[e]` = `cat(gate_proj[e], up_proj[e])` along rows: `[E, 2I, H]` (gate rows first, as in
    transformers' fused layout); `down_proj[e]` = `down_proj[e]`: `[E, H, I]`.
    """
    if which == "gate_up_proj":
        return torch.stack([torch.cat([reader.get(f"{prefix}.{e}.gate_proj.weight", wanted_by=wanted_by),
                                       reader.get(f"{prefix}.{e}.up_proj.weight", wanted_by=wanted_by)])
                            for e in range(num_experts)])
    return torch.stack([reader.get(f"{prefix}.{e}.down_proj.weight", wanted_by=wanted_by)
                        for e in range(num_experts)])


EXPERTS_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


class HFSource(Source):
    """An HF safetensors directory whose names are Clover's up to a prefix: `model.X` is `{prefix}X`,
    `lm_head.weight` is itself. Routed experts are read fused if stored fused, else fused on the fly.
    Subclasses set `config` (and may override `tensor` for layouts that differ)."""

    def __init__(self, src: Path, prefix: str = "model.", ignore: Callable[[str], bool] = lambda name: False,
                 tie_word_embeddings: bool = False) -> None:
        self.src = src
        self.prefix = prefix
        # A tied checkpoint may still store a copy of the head; it is the embedding, so it is not read.
        skip = (lambda name: ignore(name) or name == LM_HEAD) if tie_word_embeddings else ignore
        self.reader = SafetensorsReader(src, ignore=skip)

    def source_name(self, name: str) -> str:
        return self.prefix + name[len("model."):] if name.startswith("model.") else name

    def tensor(self, name: str) -> torch.Tensor:
        match = EXPERTS_RE.fullmatch(name)
        if match and self.source_name(name) not in self.reader:
            layer, which = match.groups()
            return fuse_experts(self.reader, f"{self.prefix}layers.{layer}.mlp.experts", self.config.num_experts,
                                which, wanted_by=name)
        return self.reader.get(self.source_name(name), wanted_by=name)

    def unused_tensors(self) -> list[str]:
        return self.reader.unused()

    def tokenizer(self) -> Any | None:
        if not hasattr(self, "_tokenizer"):
            self._tokenizer = load_hf_tokenizer(self.src)
        return self._tokenizer

    def tokenizer_dir(self) -> Path | None:
        return self.src

    def close(self) -> None:
        self.reader.close()


# -- mask token --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MaskPlan:
    """Where the mask token lives: row `token_id`, appended when `grow`. When `init_rows` is set, the
    embedding's mask row is initialised to the mean of its first `init_rows` rows; None keeps the row."""

    token_id: int
    grow: bool
    init_rows: int | None
    tokenizer_changed: bool


def plan_mask_token(tokenizer: Any | None, rows: int, tied: bool) -> MaskPlan:
    """Decide the mask id, adding `<|mask|>` to `tokenizer` (in place) when it has no mask token.

    * The tokenizer has a mask token: it is used as it is (its row too).
    * Otherwise `<|mask|>` is added as a special token and gets the tokenizer's next id. When that id is
      an unused padded row of the embedding (Qwen: 248320 rows for ~248k tokens) the row is reused, else
      (SmolLM2: 49152 rows, 49152 tokens) the matrix grows by one row. Tokenizers number added tokens
      sequentially, so the first free row, not the last, is the one the tokenizer can name; Dream and
      Fast-dLLM v2 place their mask tokens the same way.
    * No tokenizer: grow by one row (nothing says which rows are unused).

    The new mask embedding is the mean of the real rows. One exception keeps the AR invariant exact: a reused
    padded row of a *tied* embedding is also an LM-head row whose logit the reference computes, so it is
    left as the source has it.
    """
    if tokenizer is None:
        logger.warning("no tokenizer: adding mask token id %d as a new embedding row", rows)
        return MaskPlan(rows, grow=True, init_rows=rows, tokenizer_changed=False)
    changed = tokenizer.mask_token is None or tokenizer.mask_token_id is None
    if changed:
        if len(tokenizer) > rows:
            raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the embedding matrix only {rows} rows")
        tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    mask_id = int(tokenizer.mask_token_id)
    if mask_id > rows:
        raise ValueError(f"mask token id {mask_id} is beyond the embedding's {rows} rows")
    if mask_id == rows:
        return MaskPlan(mask_id, grow=True, init_rows=rows, tokenizer_changed=changed)
    keep_row = not changed or tied
    return MaskPlan(mask_id, grow=False, init_rows=None if keep_row else mask_id, tokenizer_changed=changed)


def apply_mask_rows(name: str, tensor: torch.Tensor, plan: MaskPlan, tied: bool) -> torch.Tensor:
    """Embedding: set or append the mask row. Untied LM head: append its own mean row when growing; a
    reused padded row keeps its source value, so logits over every source row are exactly the AR model's."""
    if plan.init_rows is None:
        return tensor
    if name == EMBED:
        mean = tensor[: plan.init_rows].float().mean(0).to(tensor.dtype)
        if plan.grow:
            return torch.cat([tensor, mean[None]])
        tensor = tensor.clone()
        tensor[plan.token_id] = mean
        return tensor
    if name == LM_HEAD and not tied and plan.grow:
        return torch.cat([tensor, tensor.float().mean(0).to(tensor.dtype)[None]])
    return tensor


# -- the driver -------------------------------------------------------------------------------------------
def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return resolved


def run_conversion(source: Source, dst: Path, *, force: bool = False, dtype: torch.dtype | None = None,
                   progress: bool = False) -> Path:
    """Convert `source` into a Clover checkpoint at `dst` (see the module docstring for the steps)."""
    # deferred: reading a source (the llama.cpp runner reads GGUFs through this package) needs no torch model
    from clover.model.modeling import CloverForBlockDiffusion

    tokenizer = source.tokenizer()
    if source.mask_token_id is not None:  # trained with its mask token: row and tokenizer stay as they are
        plan = MaskPlan(source.mask_token_id, grow=False, init_rows=None, tokenizer_changed=False)
    else:
        plan = plan_mask_token(tokenizer, source.config.vocab_size, source.config.tie_word_embeddings)
    config = dataclasses.replace(source.config, mask_token_id=plan.token_id,
                                 vocab_size=source.config.vocab_size + int(plan.grow))
    with torch.device("meta"):
        expected = checkpoint_tensor_shapes(CloverForBlockDiffusion(config))

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        last_dtype = dtype or torch.float32  # Clover-only tensors follow the dtype of the tensors around them
        with tqdm(total=len(expected), desc="converting", unit="tensor", disable=not progress) as bar:
            for name, shape in expected.items():
                suffix = next((s for s in CLOVER_ONLY_INIT if name.endswith("." + s)), None)
                if suffix is not None:
                    t = CLOVER_ONLY_INIT[suffix](shape, last_dtype)
                else:
                    t = apply_mask_rows(name, source.tensor(name), plan, config.tie_word_embeddings)
                if tuple(t.shape) != tuple(shape):
                    raise SourceTensorError(f"tensor {name!r}: the source gives shape {list(t.shape)}, the Clover "
                                            f"model expects {list(shape)}; check the source config.json")
                if t.is_floating_point():
                    t = t.to(dtype) if dtype is not None else t
                    last_dtype = t.dtype
                bar.update()
                yield name, t
        unused = source.unused_tensors()
        if unused:
            raise ValueError("source tensors not used by the conversion (unsupported layout or config?): "
                             + format_names(unused))

    with tempfile.TemporaryDirectory(prefix="clover-tokenizer-") as staging:
        # Unchanged HF tokenizers are copied file for file; changed (mask added) or GGUF-built ones are saved
        # as tokenizer.json + tokenizer_config.json, the chat template inside the latter.
        tokenizer_dir = source.tokenizer_dir() if tokenizer is not None else None
        if tokenizer is not None and (plan.tokenizer_changed or tokenizer_dir is None):
            tokenizer.save_pretrained(staging, save_jinja_files=False)
            tokenizer_dir = Path(staging)
        write_checkpoint(dst, config, stream(), tokenizer_dir=tokenizer_dir, overwrite=force)
    logger.info("wrote %s (vocab %d, mask token id %d)", dst, config.vocab_size, config.mask_token_id)
    return dst
