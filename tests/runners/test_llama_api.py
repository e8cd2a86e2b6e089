"""Clover's ctypes binding of llama.cpp's C API (`clover.runners.llama_api`): pinned to one xllamacpp version, its
struct layouts checked against llama.cpp's own defaults, only declared functions reachable."""

from __future__ import annotations

import ctypes
import importlib.metadata

import pytest

from clover.runners import llama_api


def test_the_struct_sizes_are_the_pinned_builds():
    """Sizes of llama.h's structs at b11549 (x86-64): a drift in the pinned build shows here first."""
    assert ctypes.sizeof(llama_api.LlamaBatch) == 56
    assert ctypes.sizeof(llama_api.LlamaModelParams) == 80
    assert ctypes.sizeof(llama_api.LlamaContextParams) == 168


def test_the_library_reads_llama_cpps_documented_defaults():
    lib = llama_api.load()
    params = lib.llama_context_default_params()
    assert (params.n_ctx, params.n_batch, params.n_ubatch, params.n_threads) == (512, 2048, 512, 4)
    # b11549's recurrent-state snapshots (n_rs_seq) sit between n_seq_max and n_outputs_max: a layout without the
    # field would read n_outputs_max (0) and n_outputs_max_per_seq (1) one field early
    assert (params.n_seq_max, params.n_rs_seq, params.n_outputs_max, params.n_outputs_max_per_seq) == (1, 0, 0, 1)
    assert (params.type_k, params.type_v, params.kv_unified) == (llama_api.GGML_TYPE_F16, llama_api.GGML_TYPE_F16,
                                                                 False)


def test_a_field_at_a_wrong_offset_is_refused():
    params = llama_api.load().llama_context_default_params()
    params.n_batch = 7  # what a layout shifted by one field would read
    with pytest.raises(ImportError, match=r"n_batch.*7.*2048.*xllamacpp==2026\.10\.11549"):
        llama_api._check_layout("llama_context_params", params, llama_api._CONTEXT_DEFAULTS)


def test_another_xllamacpp_version_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(llama_api.importlib.metadata, "version", lambda name: "2026.9.11063")
    with pytest.raises(ImportError, match=r"xllamacpp 2026\.9\.11063 is installed.*2026\.10\.11549"):
        llama_api.library_path()


def test_a_missing_xllamacpp_names_the_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(llama_api.importlib.metadata, "version", not_installed)
    with pytest.raises(ImportError, match=r"pip install 'clover\[llamacpp\]'"):
        llama_api.library_path()


def test_only_declared_functions_are_reachable():
    """An undeclared function would take pointers as 32-bit ints (a crash): it is not there to call."""
    lib = llama_api.load()
    assert lib.llama_decode.argtypes == [ctypes.c_void_p, llama_api.LlamaBatch]
    with pytest.raises(AttributeError):
        lib.llama_tokenize
