"""llama.cpp's C API, bound with ctypes to the shared library of one pinned `xllamacpp` wheel: only the functions
the llama.cpp runner and the benchmarks call, each with its argument and result types.

Why this library: PyPI ships `xllamacpp` as a prebuilt wheel (34 MB, no dependencies; llama.cpp build b11549 for
x86-64 with AVX2/FMA/F16C, plus llama.cpp's own HTTP server), where `llama-cpp-python` is a source package that
takes 7-15 minutes to compile (docs/gguf.md, "Why this binding"). Its one shared library exports llama.cpp's whole
C API; we load it with `ctypes.CDLL` and never import xllamacpp's own Python module (0.03 s).

What could break, and how it is kept from breaking silently:

* **ABI drift.** llama.cpp changes its structs between builds (b11284 → b11549 added 8 bytes to
  `llama_context_params`). The layouts below are those of `include/llama.h` at the pinned build, and `load()`
  refuses any other installed version of xllamacpp by name.
* **Struct layout.** Structs pass by value (`llama_init_from_model(model, params)`), so a wrong size or offset
  would corrupt memory. `load()` reads llama.cpp's own defaults (`llama_context_default_params`, ...) through
  these layouts and checks them against the values llama.h documents (n_ctx 512, n_batch 2048, F16 KV cache,
  ...): a field at a wrong offset reads a wrong value, and the library is refused before any model is opened.
  `n_rs_seq` (b11549's recurrent-state snapshots per sequence, between `n_seq_max` and `n_outputs_max`) is also
  checked the other way: the hybrid runner writes it and reads back what the context took (`llama_n_rs_seq`).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

XLLAMACPP_VERSION = "2026.10.11549"  # llama.cpp build b11549; pyproject.toml's `llamacpp` extra pins the same
INSTALL_HINT = (f"the llama.cpp runner needs xllamacpp=={XLLAMACPP_VERSION} (a prebuilt llama.cpp): pip install "
                "'clover[llamacpp]' (scripts/setup.sh installs it); the torch runner (--runner torch) needs nothing more")

GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1  # enum ggml_type
LLAMA_FLASH_ATTN_TYPE_AUTO, LLAMA_FLASH_ATTN_TYPE_DISABLED, LLAMA_FLASH_ATTN_TYPE_ENABLED = -1, 0, 1

llama_token = llama_pos = llama_seq_id = ctypes.c_int32
_ptr = ctypes.c_void_p


class LlamaBatch(ctypes.Structure):
    """`struct llama_batch`: n_tokens entries of each array; `logits[i]` != 0 asks for token i's logits."""

    _fields_ = [("n_tokens", ctypes.c_int32),
                ("token", ctypes.POINTER(llama_token)),
                ("embd", ctypes.POINTER(ctypes.c_float)),
                ("pos", ctypes.POINTER(llama_pos)),
                ("n_seq_id", ctypes.POINTER(ctypes.c_int32)),
                ("seq_id", ctypes.POINTER(ctypes.POINTER(llama_seq_id))),
                ("logits", ctypes.POINTER(ctypes.c_int8))]


class LlamaModelParams(ctypes.Structure):
    """`struct llama_model_params` (80 bytes at b11549); passed back as llama.cpp's defaults give it."""

    _fields_ = [("devices", _ptr), ("tensor_buft_overrides", _ptr),
                ("n_gpu_layers", ctypes.c_int32), ("split_mode", ctypes.c_int32), ("load_mode", ctypes.c_int32),
                ("lazy_mode", ctypes.c_int32), ("main_gpu", ctypes.c_int32),
                ("tensor_split", _ptr), ("progress_callback", _ptr), ("progress_callback_user_data", _ptr),
                ("kv_overrides", _ptr),
                ("vocab_only", ctypes.c_bool), ("check_tensors", ctypes.c_bool), ("use_extra_bufts", ctypes.c_bool),
                ("no_host", ctypes.c_bool), ("no_alloc", ctypes.c_bool), ("load_mtp", ctypes.c_bool)]


class LlamaContextParams(ctypes.Structure):
    """`struct llama_context_params` (168 bytes at b11549). `after_abort` is the 8-byte field b11549 has after
    `abort_callback_data` (b11284's header has none there; zero by default, never set here)."""

    _fields_ = [("n_ctx", ctypes.c_uint32), ("n_batch", ctypes.c_uint32), ("n_ubatch", ctypes.c_uint32),
                ("n_seq_max", ctypes.c_uint32), ("n_rs_seq", ctypes.c_uint32), ("n_outputs_max", ctypes.c_uint32),
                ("n_outputs_max_per_seq", ctypes.c_uint32),
                ("n_threads", ctypes.c_int32), ("n_threads_batch", ctypes.c_int32),
                ("ctx_type", ctypes.c_int32), ("rope_scaling_type", ctypes.c_int32), ("pooling_type", ctypes.c_int32),
                ("attention_type", ctypes.c_int32), ("flash_attn_type", ctypes.c_int32),
                ("rope_freq_base", ctypes.c_float), ("rope_freq_scale", ctypes.c_float),
                ("yarn_ext_factor", ctypes.c_float), ("yarn_attn_factor", ctypes.c_float),
                ("yarn_beta_fast", ctypes.c_float), ("yarn_beta_slow", ctypes.c_float),
                ("yarn_orig_ctx", ctypes.c_uint32), ("defrag_thold", ctypes.c_float),
                ("cb_eval", _ptr), ("cb_eval_user_data", _ptr),
                ("type_k", ctypes.c_int32), ("type_v", ctypes.c_int32),
                ("abort_callback", _ptr), ("abort_callback_data", _ptr), ("after_abort", _ptr),
                ("embeddings", ctypes.c_bool), ("offload_kqv", ctypes.c_bool), ("no_perf", ctypes.c_bool),
                ("op_offload", ctypes.c_bool), ("swa_full", ctypes.c_bool), ("kv_unified", ctypes.c_bool),
                ("samplers", _ptr), ("n_samplers", ctypes.c_size_t), ("ctx_other", _ptr)]


# void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data)
LogCallback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)

_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "llama_backend_init": (None, []),
    "llama_log_set": (None, [LogCallback, _ptr]),
    "llama_model_default_params": (LlamaModelParams, []),
    "llama_context_default_params": (LlamaContextParams, []),
    "llama_model_load_from_file": (_ptr, [ctypes.c_char_p, LlamaModelParams]),
    "llama_model_free": (None, [_ptr]),
    "llama_model_get_vocab": (_ptr, [_ptr]),
    "llama_vocab_n_tokens": (ctypes.c_int32, [_ptr]),
    "llama_init_from_model": (_ptr, [_ptr, LlamaContextParams]),
    "llama_free": (None, [_ptr]),
    # recurrent-state snapshots per sequence the context keeps (`n_rs_seq` as llama.cpp clamped it: 0 where the
    # model's architecture has no partial rollback)
    "llama_n_rs_seq": (ctypes.c_uint32, [_ptr]),
    "llama_get_memory": (_ptr, [_ptr]),
    "llama_memory_clear": (None, [_ptr, ctypes.c_bool]),  # (memory, data): every cell emptied, the head at 0
    "llama_memory_seq_rm": (ctypes.c_bool, [_ptr, llama_seq_id, llama_pos, llama_pos]),
    "llama_memory_seq_cp": (None, [_ptr, llama_seq_id, llama_seq_id, llama_pos, llama_pos]),
    "llama_memory_seq_pos_max": (llama_pos, [_ptr, llama_seq_id]),
    "llama_state_seq_get_size": (ctypes.c_size_t, [_ptr, llama_seq_id]),
    "llama_state_seq_get_data": (ctypes.c_size_t, [_ptr, _ptr, ctypes.c_size_t, llama_seq_id]),
    "llama_state_seq_set_data": (ctypes.c_size_t, [_ptr, _ptr, ctypes.c_size_t, llama_seq_id]),
    "llama_batch_init": (LlamaBatch, [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]),
    "llama_batch_free": (None, [LlamaBatch]),
    "llama_set_causal_attn": (None, [_ptr, ctypes.c_bool]),
    "llama_decode": (ctypes.c_int32, [_ptr, LlamaBatch]),
    "llama_synchronize": (None, [_ptr]),
    "llama_get_logits": (ctypes.POINTER(ctypes.c_float), [_ptr]),
    "llama_print_system_info": (ctypes.c_char_p, []),
    # ggml's quantiser (K-quants, which the gguf package cannot write): (type, src, dst, start, nrows, n_per_row,
    # imatrix) -> bytes written
    "ggml_quantize_chunk": (ctypes.c_size_t, [ctypes.c_int, _ptr, _ptr, ctypes.c_int64, ctypes.c_int64,
                                              ctypes.c_int64, _ptr]),
}

# What llama.h documents as the defaults, read back through the layouts above (see the module docstring)
_CONTEXT_DEFAULTS = {"n_ctx": 512, "n_batch": 2048, "n_ubatch": 512, "n_seq_max": 1, "n_rs_seq": 0, "n_outputs_max": 0,
                     "n_outputs_max_per_seq": 1,
                     "n_threads": 4, "n_threads_batch": 4, "flash_attn_type": LLAMA_FLASH_ATTN_TYPE_AUTO,
                     "yarn_ext_factor": -1.0, "defrag_thold": -1.0, "type_k": GGML_TYPE_F16,
                     "type_v": GGML_TYPE_F16, "embeddings": False, "offload_kqv": True, "no_perf": True,
                     "swa_full": True, "kv_unified": False, "samplers": None, "n_samplers": 0, "ctx_other": None}
_MODEL_DEFAULTS = {"n_gpu_layers": -1, "main_gpu": 0, "vocab_only": False, "use_extra_bufts": True,
                   "no_alloc": False}


def library_path() -> Path:
    """The installed xllamacpp's shared library, after checking that it is the pinned version."""
    try:
        version = importlib.metadata.version("xllamacpp")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(INSTALL_HINT) from None
    if version != XLLAMACPP_VERSION:
        raise ImportError(f"xllamacpp {version} is installed; Clover's binding of llama.cpp's C API is written for "
                          f"{XLLAMACPP_VERSION} (struct layouts change between llama.cpp builds): "
                          f"pip install 'xllamacpp=={XLLAMACPP_VERSION}'")
    spec = importlib.util.find_spec("xllamacpp")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("xllamacpp*.so")) if spec else []
    if not found:
        raise ImportError(f"xllamacpp {version} is installed but has no shared library; {INSTALL_HINT}")
    return found[0]


@functools.cache
def load() -> SimpleNamespace:
    """llama.cpp's functions listed above, with their signatures (and only those: a function called without one
    would pass pointers as C ints), the struct layouts checked, the backend initialised."""
    cdll = ctypes.CDLL(str(library_path()))
    lib = SimpleNamespace()
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(cdll, name)
        fn.restype, fn.argtypes = restype, argtypes
        setattr(lib, name, fn)
    _check_layout("llama_context_params", lib.llama_context_default_params(), _CONTEXT_DEFAULTS)
    _check_layout("llama_model_params", lib.llama_model_default_params(), _MODEL_DEFAULTS)
    lib.llama_backend_init()
    return lib


def _check_layout(name: str, params: ctypes.Structure, expected: dict[str, Any]) -> None:
    wrong = {k: getattr(params, k) for k, v in expected.items() if getattr(params, k) != v}
    if wrong:
        raise ImportError(f"llama.cpp's default {name} read through Clover's layout gives {wrong}, where llama.h "
                          f"documents {({k: expected[k] for k in wrong})}: this library's structs differ from "
                          f"xllamacpp {XLLAMACPP_VERSION}'s; reinstall it (pip install "
                          f"'xllamacpp=={XLLAMACPP_VERSION}')")


def quantize_rows(data: Any, ggml_type: int, type_size: int, block: int) -> Any:
    """`data` (float32 numpy, rows along the last axis) quantised by ggml's own `ggml_quantize_chunk` to
    `ggml_type` (`block` weights in `type_size` bytes): uint8 `[..., row_bytes]`, as the gguf package stores
    quantised rows."""
    import numpy as np  # deferred with the rest of the export

    rows = np.ascontiguousarray(data, dtype=np.float32).reshape(-1, data.shape[-1])
    row_bytes = data.shape[-1] // block * type_size
    out = np.empty((rows.shape[0], row_bytes), dtype=np.uint8)
    written = load().ggml_quantize_chunk(ggml_type, rows.ctypes.data, out.ctypes.data, 0, rows.shape[0],
                                         rows.shape[1], None)
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out.reshape(*data.shape[:-1], row_bytes)


@functools.cache
def quiet_log() -> Any:
    """A log callback that drops llama.cpp's messages; one for the process, as C keeps calling it for good."""
    return LogCallback(lambda level, text, data: None)


def free_all(lib: SimpleNamespace, batch: LlamaBatch, ctx: int, model: int) -> None:
    """Free a batch, its context and its model (a `weakref.finalize` callback of their owner, or its close())."""
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)
