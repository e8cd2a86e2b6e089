"""`clover export --to gguf SRC OUT.gguf --quant Q`: write a Clover checkpoint as a llama.cpp GGUF file."""

from __future__ import annotations

import argparse
from typing import Any

from clover.choices import GGUF_QUANTS
from clover.cli.loading import resolve_model_dir


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export", help="export a Clover checkpoint as a GGUF file for llama.cpp",
        description="Write a Clover checkpoint as a GGUF file: a dense Llama-family one as llama.cpp's llama "
                    "architecture (`clover convert --from gguf` reads it back), a hybrid Gated DeltaNet one's causal "
                    "path as llama.cpp's qwen35moe / qwen35 (block size 1 and exact mode on --runner llamacpp): "
                    "merged weights (optionally quantised), tokenizer with the mask token, chat template, and "
                    "Clover's decoding defaults as clover.* metadata. Plain llama.cpp runs it autoregressively.")
    parser.add_argument("--to", dest="target_format", choices=["gguf"], default="gguf", help="target format")
    parser.add_argument("src", help="a Clover checkpoint directory, or clover-smol for the default model (with a "
                                    "gated adapter: its causal path, as --drop-gated-adapter)")
    parser.add_argument("out", help="the .gguf file to write (must not exist unless --force)")
    parser.add_argument("--quant", choices=GGUF_QUANTS, default="f16",
                        help="weight format: f32 (exact), f16, q8_0, q4_0 (blocks of 32), q4_k (a MoE hybrid's experts "
                             "at Q4_K, the rest q8_0; default f16)")
    parser.add_argument("--tokenizer-pre", default=None,
                        help="llama.cpp pre-tokenizer name, when it cannot be told from tokenizer.json")
    parser.add_argument("--drop-gated-adapter", action="store_true",
                        help="a gated adapter (query positions only) cannot be merged: export the model without it, "
                             "its causal path (block size 1 and exact mode give its answers)")
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from clover.conversion.gguf_export import export_gguf  # deferred for start-up time: it imports torch
    from clover.runners.llama_api import quantize_rows  # deferred: ctypes and llama.cpp's library, loaded on use

    default = args.src == "clover-smol"
    src = resolve_model_dir(None if default else args.src)
    # the default model's GGUF is what `--runner llamacpp` runs (clover.smol.clover_smol_gguf): its causal path
    print(export_gguf(src, args.out, args.quant, tokenizer_pre=args.tokenizer_pre,
                      drop_gated_adapter=args.drop_gated_adapter or default, force=args.force, progress=True,
                      kquant=quantize_rows if args.quant == "q4_k" else None))
    return 0
