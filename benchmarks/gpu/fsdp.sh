#!/usr/bin/env bash
# The FSDP trainer on one lent GPU, in one call (issue: sharded training): its step time beside
# the plain trainer's (world size 1, NCCL), a short training run through the rank processes on
# CUDA (and one with the rank's own engine, train.colocate), and the largest Qwen2.5-shaped model that trains one step, without and with CPU offload.
# Every step under its own limit; results under OUTDIR as they come.
#
#   bash benchmarks/gpu/fsdp.sh OUTDIR        (wheels in .whl/ as benchmarks/gpu/README.md says)
#   SMALL=1 DEV=cpu NO_WHEELS=1 PY=.venv/bin/python bash benchmarks/gpu/fsdp.sh /tmp/out   (a CPU dry run)
set -u
OUT=${1:?usage: fsdp.sh OUTDIR}
DEV=${DEV:-cuda}; PY=${PY:-python3}
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
if [ "${NO_WHEELS:-0}" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1; nproc; free -g | head -2; } | tee "$OUT/env.txt"
run() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s) $(date +%T)"; local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "=== $name rc=$? in $(( $(date +%s) - t0 ))s"; tail -n "${TAIL:-6}" "$OUT/$name.log" | cut -c1-400; }
if [ "${SMALL:-0}" = 1 ]; then SHAPES="tiny"; else SHAPES="1.5b 3b 7b"; fi
TAIL=4 run step 55 $PY benchmarks/gpu/fsdp_check.py step --repeats 3 --json "$OUT/fsdp_step.json"
$PY -c "from rollover.testing import save_tiny_model; save_tiny_model('/tmp/fsdp_tiny', 'llama', seed=3)"
rm -rf /tmp/fsdp_run
run train_ranks 45 $PY -m rollover.cli train device=$DEV model=/tmp/fsdp_tiny run_dir=/tmp/fsdp_run steps=3 \
  "data.train=gen:arithmetic?n=120" data.eval_size=4 rollout.prompts_per_step=4 rollout.samples_per_prompt=3 \
  rollout.max_new_tokens=6 eval.every=0 checkpoint.every=3 logging.progress=false train.parallel=fsdp train.ranks=1
ls /tmp/fsdp_run/checkpoints/*/ >> "$OUT/train_ranks.log" 2>&1
rm -rf /tmp/fsdp_colocated   # the rank's own engine on its GPU (train.colocate)
run colocated 45 $PY -m rollover.cli train device=$DEV model=/tmp/fsdp_tiny run_dir=/tmp/fsdp_colocated steps=3 \
  "data.train=gen:arithmetic?n=120" data.eval_size=4 rollout.prompts_per_step=4 rollout.samples_per_prompt=3 \
  rollout.max_new_tokens=6 eval.every=0 checkpoint.every=3 logging.progress=false train.parallel=fsdp train.ranks=1 \
  train.colocate=true
TAIL=4 run colocated_memory 150 $PY benchmarks/gpu/fsdp_check.py colocated --shape 0.5b --timeout 70 \
  --json "$OUT/fsdp_colocated_memory.json"
TAIL=4 run largest 125 $PY benchmarks/gpu/fsdp_check.py largest --shapes $SHAPES --timeout 60 --json "$OUT/fsdp_largest.json"
TAIL=4 run largest_offload 80 $PY benchmarks/gpu/fsdp_check.py largest --shapes 3b 7b --offload --timeout 60 \
  --json "$OUT/fsdp_largest_offload.json"
echo "=== done $(date +%T)"
