"""How much of clover-smol's next-token prediction a weight format keeps: top-1 agreement with the unquantised model.

    python benchmarks/bench_quant_agreement.py [--text docs/architecture.md] [--tokens 400] [--threads 2]
        [--variants int8,int4,rtn-int8,rtn-int4,int4/int8x2] [--out FILE]

One causal forward over the first `--tokens` tokens of `--text` per variant; the figure is the share of positions
whose argmax over the tokenizer's vocabulary equals the unquantised (fp32, merged) model's, with the mean KL
divergence from it (nats). Variants: `int8` / `int4` are clover-smol's quantised builds (`clover.smol.
build_quantized`: the base quantised unmerged, the adapter kept beside it as a low-rank correction); `rtn-int8` /
`rtn-int4` quantise the merged checkpoint at load (what any other checkpoint gets); `bf16`, `fp32`: the packed
kernel with unquantised weights (`bf16` rounded to bfloat16). An int8 / int4 variant may name how the kernel
rounds its activations, `int4/int8` (one int8 pass) or `int4/int8x2` (two; default: the checkpoint's own).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from clover.model import CloverForBlockDiffusion, quantize
from clover.smol import clover_smol_dir
from clover.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def variant_model(name: str) -> CloverForBlockDiffusion:
    quant, _, activations = name.partition("/")
    if quant.startswith("rtn-"):
        return quantize(CloverForBlockDiffusion.from_pretrained(clover_smol_dir()), quant[4:],
                        activations=activations or None)
    return quantize(CloverForBlockDiffusion.from_pretrained(clover_smol_dir(quant)), quant,
                    activations=activations or None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=str(ROOT / "docs" / "architecture.md"),
                        help="a text file (default: docs/architecture.md)")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default="int8,int4,rtn-int8,rtn-int4")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(clover_smol_dir())
    ids = tokenizer(Path(args.text).read_text())["input_ids"][: args.tokens]
    if len(ids) < 2:
        parser.error(f"--text {args.text} has fewer than 2 tokens")
    batch, vocab = torch.tensor([ids]), len(tokenizer)
    report = {"text": Path(args.text).name, "tokens": len(ids), "threads": args.threads,
              "machine": platform.processor() or platform.machine(), "variants": {}}
    with torch.inference_mode():
        ref = CloverForBlockDiffusion.from_pretrained(clover_smol_dir())(batch).logits[0, :, :vocab].float()
        ref_logp, ref_top = ref.log_softmax(-1), ref.argmax(-1)
        for name in args.variants.split(","):
            logits = variant_model(name)(batch).logits[0, :, :vocab].float()
            logp = logits.log_softmax(-1)
            figures = {"top1_agreement": (logits.argmax(-1) == ref_top).float().mean().item(),
                       "kl_nats": (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()}
            report["variants"][name] = figures
            print(f"{name:16} top-1 agreement {figures['top1_agreement']:.3f}  KL {figures['kl_nats']:.2e} nats "
                  f"({len(ids)} tokens of {report['text']})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
