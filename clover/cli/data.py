"""`clover data`: offline training data.

    clover data text  SRC... --tokenizer DIR --out DIR [--max-len N]   files / directories / globs, one doc each
    clover data jsonl SRC... --tokenizer DIR --out DIR [--field text]  {"text": ...} lines
    clover data chat  SRC... --tokenizer DIR --out DIR                 {"messages": [...], "tools": [...]} lines
    clover data bfcl  --split {train,eval,live_simple} OUT.jsonl       BFCL as tool-calling chat JSONL

The first three write token shards (`clover.training.data`); `bfcl` writes chats (`clover.training.bfcl`)
that `clover data chat` then tokenizes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from clover.atomic_files import atomic_path
from clover.choices import BFCL_SPLITS, DEFAULT_MAX_LEN, DEFAULT_SHARD_TOKENS, OVERLONG_POLICIES, TRAIN_CATEGORIES

_KINDS = {
    "text": "plain text or code files (a file, a directory, or a quoted glob); each file is one document",
    "jsonl": 'JSON lines {"text": ...}; each line is one document',
    "chat": 'JSON lines {"messages": [...], "tools": [...]}; loss on assistant answers only',
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("data", help="prepare offline training data (token shards, BFCL chats)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="SOURCE")
    for kind, help_text in _KINDS.items():
        p = sub.add_parser(kind, help=help_text, description=help_text)
        p.add_argument("sources", nargs="+", help="input files, directories or glob patterns")
        p.add_argument("--tokenizer", required=True,
                       help="checkpoint or tokenizer directory, or a .gguf file")
        p.add_argument("--out", required=True, type=Path, help="output shard directory")
        p.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN,
                       help=f"longest document in tokens; 0 means no limit (default {DEFAULT_MAX_LEN})")
        p.add_argument("--overlong", choices=OVERLONG_POLICIES, default=None,
                       help="what to do with longer documents (default: truncate chats, split the rest)")
        p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
        p.add_argument("--mask-token-id", type=int, default=None,
                       help="[MASK] id to record in meta.json (default: from the checkpoint or tokenizer)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
        if kind != "chat":
            p.add_argument("--no-eos", dest="append_eos", action="store_false",
                           help="do not append the tokenizer's EOS to each document")
        if kind == "jsonl":
            p.add_argument("--field", default="text", help="JSON key holding the text (default: text)")
    p = sub.add_parser("bfcl", help="Berkeley Function Calling Leaderboard as tool-calling chat JSONL",
                       description="Berkeley Function Calling Leaderboard as tool-calling chat JSONL "
                                   "(see clover.training.bfcl for the splits)")
    p.add_argument("out", type=Path, help="output .jsonl file")
    p.add_argument("--split", choices=BFCL_SPLITS, default="train", help="default: train")
    p.add_argument("--category", dest="categories", action="append", default=None, metavar="CATEGORY",
                   help="a train/eval category to include; repeat for more "
                        f"(default: all of {', '.join(TRAIN_CATEGORIES)})")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    parser.set_defaults(func=run)


def _write_jsonl(rows: list[dict], out: Path, overwrite: bool) -> None:
    """One JSON object per line, written to a temporary file next to `out` and renamed into place."""
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def run(args: argparse.Namespace) -> int:
    # deferred for start-up time: clover.training imports torch and transformers
    from clover.training.bfcl import bfcl_to_chats
    from clover.training.data import prepare_token_shards

    if args.data_command == "bfcl":
        chats = bfcl_to_chats(args.split, args.categories)
        _write_jsonl(chats, args.out, args.overwrite)
        print(f"wrote {len(chats)} BFCL {args.split} chats to {args.out}")
        return 0
    meta = prepare_token_shards(
        args.data_command, args.sources, args.tokenizer, args.out, max_len=args.max_len or None,
        overlong=args.overlong, append_eos=getattr(args, "append_eos", True), field=getattr(args, "field", "text"),
        shard_tokens=args.shard_tokens, mask_token_id=args.mask_token_id, overwrite=args.overwrite)
    print(f"wrote {meta['num_documents']} documents, {meta['num_tokens']} tokens "
          f"({meta['num_loss_tokens']} trained) in {len(meta['shards'])} shards to {args.out} "
          f"[split {meta['num_split']}, truncated {meta['num_truncated']}, dropped {meta['num_dropped']}]")
    return 0
