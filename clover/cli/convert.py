"""`clover convert --from FORMAT SRC DST`: write a Clover checkpoint from an AR checkpoint."""

from __future__ import annotations

import argparse
from typing import Any

from clover.choices import SOURCE_FORMATS


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert an AR checkpoint (HF directory or GGUF file) into a Clover checkpoint",
        description="Convert an AR checkpoint into a Clover checkpoint directory (config.json, safetensors, "
                    "tokenizer, generation_config.json). The result's block_size=1 forward equals the source.")
    parser.add_argument("--from", dest="source_format", required=True, choices=list(SOURCE_FORMATS),
                        help="source layout")
    parser.add_argument("src", help="source: an HF model directory, or a .gguf file for --from gguf")
    parser.add_argument("dst", help="destination checkpoint directory (must not exist unless --force)")
    parser.add_argument("--force", action="store_true", help="replace an existing destination")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="cast weights (default: keep the source's; GGUF is dequantised to float32)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from clover.conversion import convert  # deferred for start-up time: it imports torch

    out = convert(args.source_format, args.src, args.dst, force=args.force, dtype=args.dtype, progress=True)
    print(out)
    return 0
