#!/usr/bin/env bash
# Re-measure every figure in docs/benchmarks.md (CPU: about 1.5 hours on 2 cores).
# Usage: bash benchmarks/run_all.sh [OUT_DIR]   (run on an otherwise idle machine)
set -euo pipefail
out=${1:-bench-out}
mkdir -p "$out"
rollover bench engine --json "$out/engine.json" | tee "$out/engine.txt"
rollover bench train --json "$out/train.json" | tee "$out/train.txt"
rollover bench april --json "$out/april.json" | tee "$out/april.txt"
rollover bench async --json "$out/async.json" | tee "$out/async.txt"
# the demo in its three modes (reward curves in docs/)
for cfg in arith arith_april arith_async; do
  rollover train "examples/$cfg.yaml" "run_dir=$out/runs/$cfg" resume=never | tee "$out/$cfg.txt"
done
python -m rollover.bench.curves "$out/runs" docs
