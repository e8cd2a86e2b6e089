"""Clover checkpoint -> a llama.cpp GGUF file (`clover export --to gguf`).

A dense Llama-family checkpoint becomes an ordinary llama.cpp `llama` model (the inverse of `gguf.py`); a hybrid
(Gated DeltaNet) one its causal path as llama.cpp's `qwen35moe` / `qwen35` (`gguf_hybrid.py`, which also lists what
is dropped and what is refused). Plain llama.cpp decodes either autoregressively unchanged, and the file carries
what block decoding needs:

* the weights, with an adapter merged (a gated one, which acts at query positions only, cannot be: it is refused,
  or with `drop_gated_adapter` left out, so the file holds the model's causal path, exactly what block size 1 and
  exact mode compute), Q/K rows permuted to ggml's RoPE layout (`permute_qk`, the inverse of `gguf.unpermute_qk`);
* the tokenizer as `tokenizer.ggml.*` (byte-level BPE: tokens, token types, merges, special ids), the mask
  token included as a control token, and the checkpoint's chat template;
* Clover's decoding defaults under the `clover.` namespace (`CLOVER_KEYS`), which `clover convert --from gguf`
  reads back;
* Llama 3's RoPE scaling (`rope_scaling`) as llama.cpp's converter writes it, a `rope_freqs` tensor of per-frequency
  divisors, and as `clover.rope_scaling` for the way back.

Quantisation (`QUANTS`): `f32` keeps every tensor at fp32 (a round trip through `convert --from gguf` is then
bit-exact); `f16` stores the matrices at fp16; `q8_0` / `q4_0` quantise each matrix row in blocks of 32 (one
fp16 scale per block: `w = d * q`). Norm weights stay fp32 in every mode, and with `q4_0` the token embedding
(which is also the output layer when tied) is kept at `q8_0`, as llama.cpp's own quantiser keeps the output
layer at higher precision. `q4_k` (MoE hybrids) stores the routed experts, most of such a model's bytes, as Q4_K
(blocks of 256 with 6-bit sub-block scales and minimums, quantised by llama.cpp's own `ggml_quantize_chunk`, as the
gguf package cannot write K-quants) and every other matrix as q8_0. A hybrid's conv and routers stay fp32 too (`gguf_hybrid.KEEP_F32`), as llama.cpp's
quantiser keeps them. A hybrid's file holds its causal path only (block size 1 and exact mode): llama.cpp's
DeltaNet is causal, so the block-bidirectional read that block rules need stays on the torch runner.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from clover.atomic_files import atomic_path
from clover.choices import GGUF_QUANTS as QUANTS
from clover.config import FULL_ATTENTION, CloverConfig
from clover.conversion.gguf import CLOVER_KEYS, ROPE_FREQS, ROPE_SCALING_KEY, gguf_name, permute_qk
from clover.conversion.gguf_hybrid import (CONFIG_KEY, EXPERT_TENSORS, KEEP_F32, check_hybrid_exportable,
                                           hybrid_arch, hybrid_tensors, write_hybrid_metadata)
from clover.model import CloverForBlockDiffusion
from clover.model.lora import drop_adapter, has_lora, is_gated, merge_and_unload
from clover.model.rope import rope_freq_factors
from clover.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# (float32 rows, ggml type, bytes per block, weights per block) -> the rows' quantised bytes
KQuantizer = Callable[[np.ndarray, int, int, int], np.ndarray]

# llama.cpp's token types (llama_token_type) and file types (llama_ftype)
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5


def is_hybrid(config: CloverConfig) -> bool:
    return config.has_linear_attention


def check_exportable(config: CloverConfig) -> None:
    """Refuse what the GGUF architecture cannot express, naming the first offending setting."""
    if is_hybrid(config):
        check_hybrid_exportable(config)
        return
    why = None
    if config.layer_types != [FULL_ATTENTION] * config.num_hidden_layers:
        why = "its layers are not all attention layers"
    elif config.mlp_type != "dense":
        why = "it has a sparse MoE feed-forward"
    elif config.norm_type != "plain" or config.attn_output_gate or config.qk_norm:
        why = "it uses Qwen-style zero-centred norms, q/k norms or an attention output gate"
    elif config.partial_rotary_factor != 1.0:
        why = "it uses partial RoPE"
    elif config.mask_token_id is None:
        why = "it has no mask token (convert it with `clover convert` first)"
    elif not config.token_shift or config.prompt_reading != "causal":
        why = (f"its conventions (token_shift={config.token_shift}, prompt_reading={config.prompt_reading!r}) are not "
               "carried by the GGUF metadata, and the llama.cpp runner reads Clover's (token shift, causal prompt)")
    if why:
        raise ValueError(f"cannot export to GGUF: only dense Llama-family Clover checkpoints can be, and {why}")


def _ggml_type(quant: str, name: str, tensor: torch.Tensor) -> Any:
    import gguf  # deferred: gguf, for an export only

    t = gguf.GGMLQuantizationType
    if tensor.dim() == 1 or quant == "f32" or name.endswith(KEEP_F32):
        return t.F32
    if quant == "f16":
        return t.F16
    if quant == "q4_0" and name == "token_embd.weight":
        return t.Q8_0
    if quant == "q4_k":  # a hybrid's routed experts at Q4_K (most of its bytes), every other matrix at q8_0
        qtype = t.Q4_K if name.endswith(EXPERT_TENSORS) else t.Q8_0
    else:
        qtype = t.Q8_0 if quant == "q8_0" else t.Q4_0
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if tensor.shape[-1] % block:
        raise ValueError(f"cannot quantise {name} to {qtype.name}: its row length {tensor.shape[-1]} is not a "
                         f"multiple of the block size {block}; use another --quant (f16 or f32 always work)")
    return qtype


def _encode(tensor: torch.Tensor, qtype: Any, kquant: KQuantizer | None = None) -> np.ndarray:
    # deferred: gguf, for an export only
    import gguf
    from gguf.quants import quantize

    data = tensor.detach().float().cpu().numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return data
    if qtype == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # the gguf package reads K-quants but cannot write them
        if kquant is None:
            raise ValueError("--quant q4_k needs llama.cpp's quantiser: pass kquant="
                             "clover.runners.llama_api.quantize_rows (the CLI does)")
        return kquant(data, int(qtype), *reversed(gguf.GGML_QUANT_SIZES[qtype]))
    return quantize(data, qtype)


def _tokenizer_metadata(writer: Any, directory: Path, config: CloverConfig, tokenizer_pre: str | None) -> None:
    """`tokenizer.ggml.*` from the checkpoint's tokenizer.json (byte-level BPE only) and its chat template."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no tokenizer.json: a GGUF needs the tokenizer inside it")
    spec = json.loads(path.read_text())
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"{path}: GGUF export supports byte-level BPE tokenizers, got {model.get('type')!r}")
    pre = tokenizer_pre or _pre_tokenizer_name(spec.get("pre_tokenizer"))
    tokens = [f"[PAD{i}]" for i in range(config.vocab_size)]
    types = [_UNUSED] * config.vocab_size
    for token, i in model["vocab"].items():
        if i < config.vocab_size:
            tokens[i], types[i] = token, _NORMAL
    for added in spec.get("added_tokens", []):
        i = added["id"]
        if i >= config.vocab_size:
            raise ValueError(f"{path}: token {added['content']!r} has id {i}, beyond the model's "
                             f"{config.vocab_size} embedding rows")
        tokens[i], types[i] = added["content"], _CONTROL if added.get("special") else _USER_DEFINED
    if types[config.mask_token_id] != _CONTROL:
        raise ValueError(f"{path}: the mask token id {config.mask_token_id} is not a special token of the tokenizer")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    tokenizer = load_tokenizer(directory)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    # the config's ids (what `convert --from gguf` reads back); EOS falls back to the tokenizer's, which plain
    # llama.cpp needs to stop
    special = {"bos": config.bos_token_id, "pad": config.pad_token_id, "unk": tokenizer.unk_token_id,
               "eos": config.eos_token_ids[0] if config.eos_token_ids else tokenizer.eos_token_id}
    for kind, token_id in special.items():
        if token_id is not None:
            getattr(writer, f"add_{kind}_token_id")(int(token_id))
    writer.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    writer.add_add_space_prefix(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's name for a tokenizer.json pre-tokenizer it implements identically: plain byte-level with the
    GPT-2 regex is `gpt-2` (while `tokenizer.ggml.model` is `gpt2`). Anything else must be named with
    `tokenizer_pre` (`--tokenizer-pre`)."""
    if pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt-2"
    raise ValueError("cannot tell which llama.cpp pre-tokenizer matches this tokenizer.json's pre_tokenizer "
                     f"{json.dumps(pre)[:200]}; name it with --tokenizer-pre (e.g. gpt-2, smollm, qwen2)")


def _write_llama_metadata(writer: Any, config: CloverConfig) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if config.rope_scaling is not None:  # read back by `convert --from gguf`; llama.cpp reads the rope_freqs tensor
        writer.add_string(ROPE_SCALING_KEY, json.dumps(config.rope_scaling))


def _llama_tensors(state: dict[str, torch.Tensor], config: CloverConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) of a dense checkpoint: llama names, Q/K rows in ggml's RoPE order."""
    if config.rope_scaling is not None:  # Llama 3's scaling, as llama.cpp's converter writes it
        yield ROPE_FREQS, rope_freq_factors(config.rotary_dim, config.rope_theta, config.rope_scaling)
    for name, tensor in state.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        gname = gguf_name(name)
        if gname.endswith("attn_q.weight"):
            tensor = permute_qk(tensor, config.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            tensor = permute_qk(tensor, config.num_key_value_heads)
        yield gname, tensor


def export_gguf(src: str | Path, out: str | Path, quant: str = "f16", *, tokenizer_pre: str | None = None,
                drop_gated_adapter: bool = False, force: bool = False, progress: bool = False,
                kquant: KQuantizer | None = None) -> Path:
    """Write the Clover checkpoint directory `src` as a GGUF file `out` (see the module docstring). `kquant`: the
    K-quant writer `q4_k` needs (`clover.runners.llama_api.quantize_rows`: llama.cpp's own, a layer above this one).

    The file is written to a temporary name beside `out` and renamed when complete: a failure leaves nothing.
    """
    import gguf  # deferred: gguf, for an export only

    if quant not in QUANTS:
        raise ValueError(f"unknown quantisation {quant!r}; choose one of {', '.join(QUANTS)}")
    src, out = Path(src), Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass force=True (--force) to replace it")
    config = CloverConfig.from_file(src)
    check_exportable(config)
    model = CloverForBlockDiffusion.from_pretrained(src, dtype=torch.float32)
    if is_gated(model) and drop_gated_adapter:  # the causal path: what block size 1 and exact mode compute
        model = drop_adapter(model)
    elif is_gated(model):
        raise ValueError(f"cannot export {src} to GGUF: its adapter is gated (it acts at query positions only, "
                         "so it cannot be merged into the weights, and llama.cpp applies adapters everywhere); "
                         "run it with the torch runner, or export its causal path alone (--drop-gated-adapter: "
                         "block size 1 and exact mode give the model's own answers, drafting without the adapter)")
    elif has_lora(model):  # an adapter stored beside the weights: a GGUF holds merged weights only
        model = merge_and_unload(model)
    state = model.state_dict()

    with atomic_path(out) as tmp:
        hybrid = is_hybrid(config)
        writer = gguf.GGUFWriter(str(tmp), hybrid_arch(config) if hybrid else "llama")
        writer.add_name(src.resolve().name)
        if hybrid:
            write_hybrid_metadata(writer, config)
            writer.add_string(CONFIG_KEY, json.dumps(config.to_dict()))
        else:
            _write_llama_metadata(writer, config)
        if quant == "q4_k" and not hybrid:
            raise ValueError("--quant q4_k quantises a MoE model's routed experts: this checkpoint has none; use "
                             "q4_0 or q8_0")
        ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                 "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_M}[quant]
        writer.add_file_type(ftype)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, field in CLOVER_KEYS.items():
            value = getattr(config, field)
            {int: writer.add_uint32, float: writer.add_float64, str: writer.add_string}[type(value)](key, value)
        _tokenizer_metadata(writer, src, config, tokenizer_pre)

        tensors = hybrid_tensors(state, config) if hybrid else _llama_tensors(state, config)
        for gname, tensor in tqdm(tensors, desc=f"exporting ({quant})", unit="tensor", disable=not progress):
            qtype = _ggml_type(quant, gname, tensor)
            writer.add_tensor(gname, _encode(tensor, qtype, kquant), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
        writer.close()
    logger.info("wrote %s (%s, vocab %d, mask token id %d)", out, quant, config.vocab_size, config.mask_token_id)
    return out
