#!/usr/bin/env bash
# The real SmolLM2-135M-Instruct learning on a lent GPU, in one call after the model's parts
# (benchmarks/gpu/carry.py): the README's demo in four precisions (bf16 rollout with bf16
# autocast training, the CUDA default; fp32 both; bf16 rollout with an fp32 trainer; the default
# with truncated importance sampling),
# APRIL, async and multi-turn (examples/arith_{april,async,retry}.yaml), 3 seeds each, and the
# demo's time to accuracy against TRL's GRPOTrainer (`rollover bench learn --policies grpo d3s
# trl`). The runs of a wave go side by side (the GPU and 16 cores have room for nine 135M runs),
# so their wall times are not benchmarks; the TRL comparison runs alone. Each wave runs under
# min(its limit, time left before the deadline); metrics.jsonl of every run, the logs and a
# summary are tarred into OUTDIR after every wave (a cut-off call still returns them).
# benchmarks/gpu/learn_report.py turns the tarball into the table and curves of docs/gpu.md.
#
#   bash benchmarks/gpu/learn.sh OUTDIR [SECONDS]      (from the repository root, on the device)
#
# Needs: the GGUF joined under /tmp/site (`carry.py join --smollm2 /tmp/site`), the wheels of
# benchmarks/gpu/run.sh in .whl/. SMALL=1 DEV=cpu shrinks everything to try it on a CPU.
set -u
OUT=${1:?usage: learn.sh OUTDIR [SECONDS]}
DEADLINE=$(( $(date +%s) + ${2:-480} ))
DEV=${DEV:-cuda}
RES=/tmp/learn-res; RUNS=/tmp/learn-runs; rm -rf "$RES" "$RUNS"; mkdir -p "$RES" "$RUNS" "$OUT"
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 ROLLOVER_CACHE=${ROLLOVER_CACHE:-/tmp/rc_real} TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
if [ "${SMALL:-0}" = 1 ]; then SEEDS="0"; SHRINK="steps=2 data.eval_size=8 rollout.prompts_per_step=2 eval.every=1"; LSTEPS=2
else SEEDS="0 1 2"; SHRINK=""; LSTEPS=20; fi
COMMON="device=$DEV resume=never logging.progress=false logging.tensorboard=false checkpoint.every=0 checkpoint.keep=1"

pack() {  # every run's metrics.jsonl and log beside the summaries, in one tarball
  for d in "$RUNS"/*/; do local n; n=$(basename "$d"); mkdir -p "$RES/runs/$n"
    cp "$d/metrics.jsonl" "$d/train.log" "$RES/runs/$n/" 2>/dev/null; done
  tar czf "$OUT/learn.tgz" -C "$RES" .; }
wave() {  # wave NAME LIMIT_S: run every "run_dir|overrides" line of stdin side by side
  local name=$1 limit=$2 left=$(( DEADLINE - $(date +%s) - 10 ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then echo "=== $name skipped: ${left}s left"; return; fi
  echo "=== $name (limit ${limit}s) $(date +%T)"
  local t0=$(date +%s) pids=()
  while IFS='|' read -r run cfg over; do
    mkdir -p "$RUNS/$run"
    ( s0=$(date +%s%N); timeout -k 5 "$limit" $PY -m rollover.cli train $cfg run_dir="$RUNS/$run" $COMMON $SHRINK $over \
      > "$RUNS/$run/train.log" 2>&1; rc=$?
      echo "rc=$rc wall_ms=$(( ($(date +%s%N) - s0) / 1000000 ))" >> "$RUNS/$run/train.log"
      rm -rf "$RUNS/$run/checkpoints" ) &
    pids+=($!)
  done
  wait "${pids[@]}"
  echo "=== $name done in $(( $(date +%s) - t0 ))s"
  pack
  $PY benchmarks/gpu/learn_report.py "$RES" | tee "$RES/summary.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $PY -c "import torch, transformers, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no cuda')"
  nproc; } > "$RES/env.txt" 2>&1
cat "$RES/env.txt"
if [ "${NO_WHEELS:-0}" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > "$RES/pip.log" 2>&1 || { tail "$RES/pip.log"; exit 1; }
fi
t0=$(date +%s)
$PY -c "from rollover.models import resolve_model; print('model at', resolve_model('smollm2-135m-instruct'))" || exit 1
echo "=== model converted in $(( $(date +%s) - t0 ))s"

A=examples/arith.yaml
# 1. precision: which CUDA default learns (the rollout-vs-trainer gap is actor/rollout_kl per step)
for s in $SEEDS; do
  echo "bf16_s$s|$A|seed=$s"
  echo "fp32_s$s|$A|seed=$s rollout.dtype=float32 train.dtype=float32"
  echo "bf16r_fp32t_s$s|$A|seed=$s train.dtype=float32"
  echo "bf16tis_s$s|$A|seed=$s algorithm.tis_cap=2.0"
done | wave precision 170
# 2. every mode on the real model (default precision)
for s in $SEEDS; do
  echo "april_s$s|examples/arith_april.yaml|seed=$s"
  echo "async_s$s|examples/arith_async.yaml|seed=$s"
  echo "retry_s$s|examples/arith_retry.yaml|seed=$s"
done | wave modes 170
# 3. time to accuracy against TRL, alone on the GPU (seed 0; rollover GRPO, D3S, TRL in turn)
t0=$(date +%s); left=$(( DEADLINE - t0 - 10 ))
if [ "$left" -gt 60 ]; then
  echo "=== learn_trl (limit ${left}s) $(date +%T)"
  timeout -k 5 "$left" $PY -m rollover.cli bench learn --task demo --policies grpo d3s trl --seeds 1 --steps $LSTEPS \
    --eval-every 5 --eval-size 48 --eval-samples 4 --threshold 0.8 --json "$RES/learn_trl.json" device=$DEV $SHRINK \
    > "$RES/learn_trl.log" 2>&1
  echo "=== learn_trl rc=$? in $(( $(date +%s) - t0 ))s"; tail -n 12 "$RES/learn_trl.log" | cut -c1-300
  pack
fi
# 4. the modes in fp32, if time is left
for s in $SEEDS; do
  echo "april_fp32_s$s|examples/arith_april.yaml|seed=$s rollout.dtype=float32 train.dtype=float32"
  echo "async_fp32_s$s|examples/arith_async.yaml|seed=$s rollout.dtype=float32 train.dtype=float32"
  echo "retry_fp32_s$s|examples/arith_retry.yaml|seed=$s rollout.dtype=float32 train.dtype=float32"
done | wave modes_fp32 170
echo "=== done $(date +%T)"
