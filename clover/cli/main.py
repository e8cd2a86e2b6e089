"""`clover` console script: dispatches to one module per subcommand.

Each subcommand module exposes `add_parser(subparsers)` (which registers its arguments and sets
`func=run`) and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand name -> module under clover.cli
SUBCOMMANDS = ["convert", "export", "info", "generate", "decide", "chat", "data", "train", "plot", "serve"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clover", description="Clover block-diffusion language models")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"clover.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as exc:
        print(f"clover {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
