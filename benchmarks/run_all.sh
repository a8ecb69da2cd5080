#!/usr/bin/env bash
# Re-measure every figure in docs/benchmarks.md (CPU: about 3.5 hours on 2 cores).
# Usage: bash benchmarks/run_all.sh [OUT_DIR]   (run on an otherwise idle machine)
set -euo pipefail
out=${1:-bench-out}
mkdir -p "$out"
rollover bench engine --json "$out/engine.json" | tee "$out/engine.txt"
rollover bench train --compare plain --json "$out/train.json" | tee "$out/train.txt"   # plain,trl with pip install trl
rollover bench april --repeats 3 --json "$out/april.json" | tee "$out/april.txt"
rollover bench async --json "$out/async.json" | tee "$out/async.txt"
rollover bench faults --trials 20 --kills-per-chain 5 --steps 12 --json "$out/faults.json" | tee "$out/faults.txt"
rollover bench envs --steps 3 --json "$out/envs.json" | tee "$out/envs.txt"
python -c "from rollover.testing import save_tiny_model; save_tiny_model('$out/tiny', 'llama', seed=5)"
rollover bench envs --model "$out/tiny" --steps 12 --json "$out/envs_tiny.json" | tee "$out/envs_tiny.txt"
rollover bench memory --json "$out/memory.json" | tee "$out/memory.txt"
rollover bench ray --json "$out/ray.json" | tee "$out/ray.txt"
# the simulator: calibrate, measure the benchmark it is checked against at once, validate
mkdir -p "$out/docs/sim" "$out/docs/bench"
rollover simulate calibrate --out "$out/docs/sim/cpu-smollm2-135m.json" --name cpu-smollm2-135m | tee "$out/calibrate.txt"
rollover bench april --workload longtail --json "$out/docs/bench/april_longtail_sim.json" | tee "$out/april_longtail_sim.txt"
rollover simulate validate --root "$out" --json "$out/docs/sim/validation.json" | tee "$out/validation.txt"
# the demo in its three modes (reward curves in docs/)
for cfg in arith arith_april arith_async; do
  rollover train "examples/$cfg.yaml" "run_dir=$out/runs/$cfg" resume=never | tee "$out/$cfg.txt"
done
rollover train examples/arith_retry.yaml "run_dir=$out/runs/arith_retry" resume=never | tee "$out/arith_retry.txt"
python -m rollover.bench.curves "$out/runs" docs
