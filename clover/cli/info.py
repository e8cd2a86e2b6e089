"""`clover info [DIR|PRESET]`: layers, parameter counts and the memory a model needs; with `--cost`, what one forward
of R rows costs on this machine (exact mode sizes its drafts by it: clover.engine.drafts.cost); with `--runners`, the
registered runners (clover.runners.registry)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from clover.cli.loading import add_decoding_options, load_model
from clover.cli.threads import set_threads
from clover.config import FULL_ATTENTION, PRESETS, CloverConfig
from clover.runners.registry import RUNNERS

BYTES_PER_PARAM = {"bf16": 2.0, "int8": 1.0, "int4": 0.5}


def describe(config: CloverConfig) -> dict:
    """Counts from a model built on the meta device: no weights are allocated or read."""
    # deferred for start-up time: torch and the model load only when the command runs
    import torch

    from clover.model import CloverForBlockDiffusion

    with torch.device("meta"):
        model = CloverForBlockDiffusion(config)
    total = model.num_parameters()
    attention = sum(t == FULL_ATTENTION for t in config.layer_types)
    return {
        "layers": config.num_hidden_layers,
        "full_attention_layers": attention,
        "linear_attention_layers": config.num_hidden_layers - attention,
        "mlp": (f"moe: {config.num_experts} experts, top-{config.num_experts_per_tok}"
                + (" + shared" if config.shared_expert_intermediate_size else "")
                if config.mlp_type == "moe" else f"dense SwiGLU {config.intermediate_size}"),
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "max_context": config.max_position_embeddings,
        "parameters": total,
        "active_parameters": model.num_active_parameters(),
        "active_parameters_without_embeddings": model.num_active_parameters(include_embeddings=False),
        "weights_gib": {k: total * b / 2**30 for k, b in BYTES_PER_PARAM.items()},
        "kv_cache_bytes_per_token_bf16": 2 * attention * config.num_key_value_heads * config.head_dim * 2,
        **conventions(config),
    }


def conventions(config: CloverConfig) -> dict:
    """The family, how it reads and predicts, its decoding defaults, and what Clover can do with it."""
    from clover.conversion.families import FAMILIES, capabilities  # deferred for start-up time: torch

    family = FAMILIES.get(config.family)
    return {
        "family": config.family,
        "family_title": family.title if family else "Clover",
        "conventions_source": family.source if family else "docs/design.md",
        "token_shift": config.token_shift,
        "context_reading": config.context_reading,
        "prompt_reading": config.prompt_reading,
        "block_grid": config.block_grid if config.prompt_reading == "blocks" else None,
        "deltanet_reading": config.deltanet_reading if config.has_linear_attention else None,
        "defaults": {"block_size": config.block_size, "threshold": config.threshold, "rule": config.rule,
                     "mask_token_id": config.mask_token_id},
        "can": [{"what": what, "can": can, "why": why} for what, can, why in capabilities(config)],
    }


def _load_config(target: str) -> CloverConfig:
    if target in PRESETS:
        return CloverConfig.from_preset(target)
    if Path(target).exists():
        return CloverConfig.from_file(target)
    raise ValueError(f"{target!r} is neither a checkpoint directory nor a preset ({', '.join(sorted(PRESETS))})")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("info", help="layers, parameter counts and memory of a checkpoint or preset; "
                                           "--cost: the forward cost on this machine")
    p.add_argument("target", nargs="?", default=None,
                   help="checkpoint directory or preset name (default: clover-smol, the default model)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--runners", action="store_true", help="list the registered runners (what --runner offers)")
    p.add_argument("--cost", action="store_true",
                   help="load the model as `clover generate` would (the decoding options below apply) and show its "
                        "forward cost by rows, measured once per model, runner and machine ($CLOVER_CACHE/costs)")
    p.add_argument("--recalibrate", action="store_true", help="with --cost: measure again")
    add_decoding_options(p)
    p.set_defaults(func=run)


def forward_cost(args: argparse.Namespace) -> dict:
    """The cost table of the model `args` names, as the engine's exact mode reads it."""
    # deferred for start-up time: torch and the model load only when the command runs
    from clover.engine.drafts.cost import cost_table

    set_threads(args.threads)
    args.model = args.target
    runner, _, source = load_model(args)
    return {"model": str(source), **cost_table(runner, recalibrate=args.recalibrate).summary()}


def list_runners(as_json: bool) -> None:
    runners = [{"name": e.name, "takes": e.takes, "devices": list(e.devices), "summary": e.summary}
               for e in RUNNERS.values()]
    if as_json:
        print(json.dumps(runners))
        return
    for r in runners:
        print(f"{r['name']:<10} --model a {'Clover checkpoint directory' if r['takes'] == 'checkpoint' else 'GGUF file'}"
              f" ({', '.join(r['devices'])}): {r['summary']}")


def run(args: argparse.Namespace) -> int:
    if args.runners:
        list_runners(args.json)
        return 0
    if args.cost:
        cost = forward_cost(args)
        if args.json:
            print(json.dumps(cost))
            return 0
        print(f"{cost['model']}: one forward on {cost['runner']} ({cost['threads']} threads, {cost['cpu']})")
        for rows, ms in cost["ms_by_rows"].items():
            print(f"  {rows:>3} rows   {ms:8.2f} ms   ({ms / rows:6.2f} ms a row)")
        print(f"  + {cost['us_per_context_token']:.3f} us per context token beyond {cost['context']}, "
              f"+ {cost['us_per_context_token_and_row']:.4f} us per context token and row")
        return 0
    if args.target is None:
        raise ValueError("give a checkpoint directory or a preset name (or --cost for the default model's cost)")
    info = describe(_load_config(args.target))
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{args.target}")
    print(f"  layers            {info['layers']} ({info['linear_attention_layers']} Gated DeltaNet, "
          f"{info['full_attention_layers']} attention); mlp: {info['mlp']}")
    print(f"  hidden / vocab    {info['hidden_size']} / {info['vocab_size']}; context {info['max_context']}")
    print(f"  parameters        {info['parameters'] / 1e9:.3f} B total, {info['active_parameters'] / 1e9:.3f} B active "
          f"per token ({info['active_parameters_without_embeddings'] / 1e9:.3f} B without embeddings)")
    mem = ", ".join(f"{k} {v:.2f} GiB" for k, v in info["weights_gib"].items())
    print(f"  weights           {mem}")
    print(f"  KV cache (bf16)   {info['kv_cache_bytes_per_token_bf16'] / 1024:.1f} KiB per token "
          "(DeltaNet state: fixed size)")
    print(f"  family            {info['family_title']} ({info['family']}; conventions from {info['conventions_source']})")
    shift = ("token shift: block position p is predicted from the output at p - 1" if info["token_shift"]
             else "no token shift: a masked position is predicted from its own output")
    print(f"  prediction        {shift}")
    deltanet = f"; Gated DeltaNet reads a block {info['deltanet_reading']}" if info["deltanet_reading"] else ""
    grid = {"prompt_end": " (grid ending at the prompt's end)", "absolute": " (grid at absolute positions: the "
            "prompt's last partial block opens the first generated one)", None: ""}[info["block_grid"]]
    print(f"  reading           committed context {info['context_reading']}; prompt {info['prompt_reading']}{grid}"
          f"{deltanet}")
    d = info["defaults"]
    print(f"  defaults          block {d['block_size']}, threshold {d['threshold']}, rule {d['rule']}, "
          f"mask token id {d['mask_token_id']}")
    for c in info["can"]:
        print(f"  {'can   ' if c['can'] else 'cannot'}            {c['what']}: {c['why']}")
    return 0
