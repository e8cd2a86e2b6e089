"""llama-architecture GGUF files (llama.cpp; e.g. SmolLM2-135M-Instruct.Q4_1.gguf) -> Clover's dense backbone.

Tensors are read and dequantised to fp32 with the `gguf` package. GGUF stores a matrix with its dims
reversed (`ne0` = input features), which `dequantize` already returns as PyTorch's `[out, in]`. Names map
`token_embd` / `output_norm` / `output` and `blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm,
ffn_gate, ffn_up, ffn_down}` onto Clover's (= HF Llama's) names; a missing `output.weight` means tied
embeddings.

**Q/K row permutation.** HF's rotate-half RoPE pairs channel `c` of a head with `c + d/2`; ggml's "normal"
RoPE pairs adjacent channels `(2c, 2c+1)`. llama.cpp's converter therefore reorders each head's rows of
`q_proj` / `k_proj` as `w.reshape(heads, 2, d/2, H).swapaxes(1, 2)` (interleaving the two halves);
`unpermute_qk` applies the inverse, `reshape(heads, d/2, 2, H).swapaxes(1, 2)`, with `heads` the query
heads for Q and the key/value heads for K.

Hyper-parameters come from the `llama.*` metadata; the tokenizer (with its chat template) is rebuilt by
transformers from the GGUF's `tokenizer.ggml.*` metadata and saved as `tokenizer.json` +
`tokenizer_config.json`, so the checkpoint never needs the GGUF again.

Llama 3's RoPE scaling is read back from a GGUF `clover export` wrote (`clover.rope_scaling`, checked against its
`rope_freqs` divisors); llama.cpp's own Llama 3 files carry the divisors only and are refused, naming the way that
works (`--from llama` on the HF checkpoint).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clover.config import CloverConfig
from clover.conversion.common import Source, SourceTensorError
from clover.conversion.gguf_header import GGUFHeader, read_header
from clover.conversion.llama import llama_config

_REQUIRED = object()

# Clover name (with {i} for the layer) -> GGUF name
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Clover's decoding defaults in a GGUF written by `clover export` (GGUF key -> config field)
CLOVER_KEYS = {"clover.block_size": "block_size", "clover.threshold": "threshold", "clover.rule": "rule",
               "clover.mask_token_id": "mask_token_id", "clover.context_reading": "context_reading"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Llama 3's RoPE scaling: llama.cpp reads per-frequency divisors (ROPE_FREQS); `clover export` also writes the
# scaling's own fields (CloverConfig.rope_scaling, JSON) so that it can be read back as Clover computes it
ROPE_FREQS = "rope_freqs.weight"
ROPE_SCALING_KEY = "clover.rope_scaling"


def unpermute_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of Q/K rows (module docstring)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def permute_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's per-head interleaving of Q/K rows, the inverse of `unpermute_qk` (for export)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_name(name: str) -> str:
    """The llama GGUF name of a Clover (= HF Llama) state-dict name."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = _LAYER_RE.fullmatch(name)
    if match and match.group(2) in _LAYER:
        return f"blk.{match.group(1)}.{_LAYER[match.group(2)]}"
    raise SourceTensorError(f"Clover tensor {name!r} has no counterpart in a llama GGUF")


def find_gguf(src: Path) -> Path:
    """`src` itself, or the single .gguf file inside directory `src`."""
    if src.is_file():
        return src
    if src.is_dir():
        found = sorted(src.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        raise FileNotFoundError(f"{src} holds {len(found)} .gguf files; pass the file itself")
    raise FileNotFoundError(f"GGUF source {src} not found")


class GGUFSource(Source):
    """A llama GGUF's config (from its header, read fast: clover.conversion.gguf_header) and, on demand, its
    tensors (gguf's reader, opened at the first tensor asked for)."""

    def __init__(self, src: Path) -> None:
        from transformers import LlamaConfig  # deferred: transformers, only when a GGUF is read

        self.path = find_gguf(src)
        self.header = read_header(self.path)
        arch = self._meta("general.architecture")
        if arch != "llama":
            raise ValueError(f"{self.path}: GGUF architecture is {arch!r}; --from gguf supports 'llama' only")
        self._names = set(self.header.tensors)
        self._used: set[str] = set()
        scaling = self._meta("llama.rope.scaling.type", "none")
        if scaling not in ("none", ""):
            raise ValueError(f"{self.path}: RoPE scaling (llama.rope.scaling.type {scaling!r}) is not supported: "
                             "Clover computes plain RoPE and Llama 3's scaling only")
        heads = int(self._meta("llama.attention.head_count"))
        hidden = int(self._meta("llama.embedding_length"))
        head_dim = int(self._meta("llama.attention.key_length", hidden // heads))
        rot = int(self._meta("llama.rope.dimension_count", head_dim))
        if rot != head_dim:
            raise ValueError(f"{self.path}: rope.dimension_count {rot} != head_dim {head_dim}; partial RoPE in "
                             "llama GGUFs is not supported")
        embed = self.header.tensors["token_embd.weight"]
        self.heads, self.kv_heads = heads, int(self._meta("llama.attention.head_count_kv", heads))
        hf = LlamaConfig(
            vocab_size=int(embed[-1]),  # ggml dims are reversed: [hidden, vocab]
            hidden_size=hidden,
            intermediate_size=int(self._meta("llama.feed_forward_length")),
            num_hidden_layers=int(self._meta("llama.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=self.kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(self._meta("llama.attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(self._meta("llama.context_length", 2048)),
            rope_parameters={**self._rope_scaling(), "rope_theta": float(self._meta("llama.rope.freq_base", 10000.0))},
            tie_word_embeddings="output.weight" not in self._names,
        )
        gguf_keys = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
        token_ids = {ours: self._meta(f"tokenizer.ggml.{theirs}", None) for ours, theirs in gguf_keys.items()}
        token_ids = {k: (None if v is None else int(v)) for k, v in token_ids.items()}
        config = llama_config(hf, token_ids)
        self._check_rope_freqs(config)
        # A GGUF written by `clover export` carries Clover's decoding defaults (and its mask token: `tokenizer`)
        defaults = {field: self._meta(key) for key, field in CLOVER_KEYS.items()
                    if key in self.header.metadata and field != "mask_token_id"}
        self.mask_token_id = self._meta("clover.mask_token_id", None)
        self.config = dataclasses.replace(config, **defaults)

    def _rope_scaling(self) -> dict[str, Any]:
        """The RoPE parameters besides theta: Llama 3's scaling when `clover export` wrote it, else plain. A
        `rope_freqs` tensor without it (llama.cpp's converter writes Llama 3's scaling as divisors only) is
        refused: the divisors alone do not name the scaling's fields."""
        if ROPE_FREQS not in self._names:
            return {"rope_type": "default"}
        if ROPE_SCALING_KEY not in self.header.metadata:
            raise ValueError(f"{self.path}: a {ROPE_FREQS} tensor (per-frequency RoPE divisors, as llama.cpp's "
                             f"converter writes Llama 3's scaling) without {ROPE_SCALING_KEY} is not supported: "
                             "convert the HF checkpoint instead (`clover convert --from llama`), whose config.json "
                             "names the scaling")
        return json.loads(self._meta(ROPE_SCALING_KEY))

    def _check_rope_freqs(self, config: CloverConfig) -> None:
        """The file's `rope_freqs` must be the divisors its `clover.rope_scaling` implies (what llama.cpp computes
        is what the converted model computes)."""
        if config.rope_scaling is None:
            return
        # deferred: the model package, only for a file with Llama 3's scaling (the llama.cpp runner reads GGUFs)
        from clover.model.rope import rope_freq_factors

        self._used.add(ROPE_FREQS)
        info = self._tensors[ROPE_FREQS]
        stored = torch.from_numpy(np.array(info.data, dtype=np.float32).reshape(-1))
        implied = rope_freq_factors(config.rotary_dim, config.rope_theta, config.rope_scaling)
        if stored.shape != implied.shape or not torch.allclose(stored, implied, rtol=1e-6, atol=0):
            raise ValueError(f"{self.path}: {ROPE_FREQS} is not the divisors {ROPE_SCALING_KEY} "
                             f"{config.rope_scaling} implies")

    def _meta(self, key: str, default: Any = _REQUIRED) -> Any:
        if key not in self.header.metadata:
            if default is _REQUIRED:
                raise ValueError(f"{self.path}: GGUF metadata {key!r} missing")
            return default
        return self.header.metadata[key]

    @functools.cached_property
    def _tensors(self) -> dict[str, Any]:
        """The tensors with their data, by name (gguf's reader: seconds for a large vocabulary, so only here)."""
        import gguf  # deferred: gguf, only when a tensor is read

        return {t.name: t for t in gguf.GGUFReader(str(self.path)).tensors}

    def tensor(self, name: str) -> torch.Tensor:
        from gguf.quants import dequantize  # deferred: gguf, only when a GGUF is read

        gname = gguf_name(name)
        if gname not in self._tensors:
            raise SourceTensorError(f"GGUF tensor {gname!r} (needed for Clover's {name!r}) not in {self.path}")
        self._used.add(gname)
        info = self._tensors[gname]
        shape = tuple(int(d) for d in reversed(info.shape.tolist()))
        weight = torch.from_numpy(np.array(dequantize(info.data, info.tensor_type), dtype=np.float32).reshape(shape))
        if gname.endswith("attn_q.weight"):
            weight = unpermute_qk(weight, self.heads)
        elif gname.endswith("attn_k.weight"):
            weight = unpermute_qk(weight, self.kv_heads)
        return weight

    def unused_tensors(self) -> list[str]:
        return sorted(self._names - self._used)

    def tokenizer(self) -> Any:
        if not hasattr(self, "_tokenizer"):
            self._tokenizer = gguf_tokenizer(self.path, self.mask_token_id)
        return self._tokenizer


def gguf_tokenizer(path: Path, mask_token_id: int | None) -> Any:
    """The tokenizer (and chat template) a GGUF's `tokenizer.*` metadata describes, rebuilt by transformers from
    the file alone; Clover's mask token (`clover.mask_token_id`) is marked as the mask token, with its trained row.

    Built by transformers' tokenizers backend straight from the file's tokenizer metadata. `AutoTokenizer` builds
    the same one but first reads a model config out of the file to pick a class, and for an architecture its fast
    GGUF reader does not cover (llama, qwen2, qwen3) through `gguf.GGUFReader`, which decodes every token of the
    vocabulary field by field: seconds of a first use (tests/runners/test_llamacpp_plain.py compares the two)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend  # deferred: only when one is read

    # read from a directory that holds the file alone: given the file's own directory, transformers reads a
    # `tokenizer.json` beside it instead of the file's tokenizer (clover-smol's export sits in its checkpoint's
    # directory), and no chat template, so a server rendered the model's chats with Clover's template
    with tempfile.TemporaryDirectory(prefix="clover-gguf-tokenizer-") as alone:
        (Path(alone) / path.name).symlink_to(path.resolve())
        tokenizer = TokenizersBackend.from_pretrained(alone, gguf_file=path.name)
    if mask_token_id is not None:
        tokenizer.mask_token = tokenizer.convert_ids_to_tokens(int(mask_token_id))
    return tokenizer


def gguf_architecture(path: Path, header: GGUFHeader | None = None) -> str:
    """A GGUF file's `general.architecture` (its header only is read)."""
    arch = (header or read_header(path)).get("general.architecture")
    if arch is None:
        raise ValueError(f"{path}: GGUF metadata 'general.architecture' missing")
    return arch


def written_by_clover(header: GGUFHeader) -> bool:
    """Whether a GGUF carries Clover's metadata (`clover export` wrote it) rather than being a plain AR file."""
    return any(key.startswith("clover.") for key in header.metadata)


def open_source(src: Path, source_format: str = "gguf") -> GGUFSource:
    return GGUFSource(src)


def plain_gguf_config(header: GGUFHeader, n_vocab: int) -> CloverConfig:
    """The shape of a plain autoregressive GGUF (no Clover metadata: llama.cpp's own converter wrote it, any
    architecture llama.cpp runs), read from its `{arch}.*` metadata, as a CloverConfig that the llama.cpp runner's
    causal path decodes with: rule `exact` (block size 1's answers, drafts copied from the context), and a mask
    token that is no token of the file. The engine needs a mask id (its padding, banned from sampling); the file
    has none to spare, so it is `n_vocab`, one past the vocabulary: `vocab_size` is `n_vocab + 1` and the runner
    gives that id a logit of -inf and never feeds it. The layer fields describe the file for the cost table's
    fingerprint and `clover info`; llama.cpp computes the model from the file itself."""
    path = header.path

    def meta(key: str, default: Any = _REQUIRED) -> Any:
        if key not in header.metadata:
            if default is _REQUIRED:
                raise ValueError(f"{path}: GGUF metadata {key!r} missing")
            return default
        return header.metadata[key]

    arch = meta("general.architecture")
    hidden, heads = int(meta(f"{arch}.embedding_length")), int(meta(f"{arch}.attention.head_count"))
    layers = int(meta(f"{arch}.block_count"))
    eos = [int(meta(f"tokenizer.ggml.{k}")) for k in ("eos_token_id", "eot_token_id")
           if meta(f"tokenizer.ggml.{k}", None) is not None]
    bos = meta("tokenizer.ggml.bos_token_id", None)
    return CloverConfig(
        vocab_size=n_vocab + 1, hidden_size=hidden, num_hidden_layers=layers, layer_types=["full_attention"] * layers,
        num_attention_heads=heads, num_key_value_heads=int(meta(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta(f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(meta(f"{arch}.context_length", 4096)),
        rms_norm_eps=float(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta(f"{arch}.rope.freq_base", 10000.0)), partial_rotary_factor=1.0,
        norm_type="plain", attn_output_gate=False, qk_norm="blk.0.attn_q_norm.weight" in header.tensors,
        mlp_type="dense", intermediate_size=int(meta(f"{arch}.feed_forward_length", 4 * hidden)),
        mask_token_id=n_vocab, bos_token_id=None if bos is None else int(bos),
        eos_token_id=sorted(set(eos)) if len(set(eos)) > 1 else (eos[0] if eos else None),
        block_size=4, rule="exact", context_reading="causal", family=f"gguf:{arch}", model_type="clover")

