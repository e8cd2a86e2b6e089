#!/bin/bash
# 54's before/after: the same benchmarks on 81b5ca1 (before) and main (after), taking turns.
set -x
for round in 1; do
  for side in before54 main; do
    d=/work/wt/$side; [ $side = main ] && d=/work/main
    cd $d && source .venv/bin/activate && export PYTHONPATH=$PWD
    python benchmarks/bench_serve_vs_generate.py --sections single --rounds 1 --threads 2 --out /work/probe/svg_${side}_$round > /work/probe/svg_${side}_$round.log 2>&1
    python benchmarks/bench_exact.py --limit 2 --max-new-tokens 128 --warmup 1 --threads 2 --systems default,int4-b1 --sets code,tools_heldout --out /work/probe/be_${side}_$round.json > /work/probe/be_${side}_$round.log 2>&1
  done
done
