"""`clover train CONFIG.yaml [--key value ...]`: train a Clover model with the block-diffusion objective.

Every TrainConfig key can be set on the command line after the config file, nested ones with dots:

    clover train run.yaml --lr 1e-4 --max_steps 2000 --noise.weighting inverse_rate --lora.rank 16
    torchrun --nproc_per_node 2 -m clover.cli.main train run.yaml --parallel fsdp

An unknown key is an error naming it. `--print-config` prints the resolved config (YAML) and exits. A run
resumes from `output_dir`'s latest checkpoint by default (`--resume never` starts afresh). See docs/training.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="train with the block-diffusion objective (BD3-LM)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML file of TrainConfig keys")
    parser.add_argument("overrides", nargs=argparse.REMAINDER,
                        help="--key value pairs overriding the file (nested keys with dots: --noise.t_min 0.1)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # deferred for start-up time: clover.training imports torch and transformers
    from clover.training.config import load_train_config
    from clover.training.trainer import train

    overrides = list(args.overrides)
    show = "--print-config" in overrides
    overrides = [a for a in overrides if a != "--print-config"]
    config = load_train_config(args.config, overrides)
    if show:
        sys.stdout.write(config.to_yaml())
        return 0
    if int(os.environ.get("RANK", "0")) != 0:  # one process reports
        logging.getLogger().setLevel(logging.WARNING)
    result = train(config)
    if int(os.environ.get("RANK", "0")) == 0:
        last = f"{result.losses[-1]:.4f}" if result.losses else "n/a"
        print(f"step {result.step}/{config.max_steps}  last loss {last}  checkpoint {result.checkpoint}"
              + ("  (stopped early: run the same command to resume)" if result.stopped_early else ""))
    return 0
