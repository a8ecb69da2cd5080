#!/usr/bin/env bash
# The Ray runtime on one lent GPU, in the call that brings Ray's second part (issue: the real
# path on a GPU, Ray): the Ray-on-GPU tests (tests/test_cuda_ray.py: a rollout worker actor and
# the trainer sharing the GPU, sync with the trainer in the driver and as an actor, async), then
# `rollover bench ray` with every worker on half the GPU: samples per second and weight-sync
# seconds on the local runtime and on Ray, and the seconds per update of each transport (object
# store with and without deltas, gloo). Every step under its own limit; results under OUTDIR.
#
#   bash benchmarks/gpu/ray.sh OUTDIR [SECONDS]   (after `carry.py join --name ray.tar --install /tmp/site`)
#   SMALL=1 DEV=cpu NO_WHEELS=1 PY=.venv/bin/python bash benchmarks/gpu/ray.sh /tmp/out   (a CPU dry run)
#
# Needs: Ray under /tmp/site (benchmarks/gpu/README.md, "Ray and vLLM"), the wheels of run.sh in
# .whl/ and SmolLM2's tokenizer files in .gpu/smollm2 (stand-in weights are made here).
set -u
OUT=${1:?usage: ray.sh OUTDIR [SECONDS]}
DEADLINE=$(( $(date +%s) + ${2:-420} ))
DEV=${DEV:-cuda}; PY=${PY:-python3}
source benchmarks/gpu/lib.sh
wheels --upgrade
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1; nproc
  $PY -c "import ray, torch; print('ray', ray.__version__, 'torch', torch.__version__)"; } 2>&1 | tee "$OUT/env.txt"
if [ "${SMALL:-0}" = 1 ]; then STEPS=1; UPDATES=1; GPUS=0; KILL=0; TEST_DEV=cpu
  SHRINK="rollout.prompts_per_step=2 rollout.samples_per_prompt=2 rollout.max_new_tokens=8"
else STEPS=3; UPDATES=5; GPUS=0.5; KILL=32; TEST_DEV=""; SHRINK=""; fi
stand_ins
TAIL=12 ROLLOVER_TEST_DEVICE=$TEST_DEV run tests 150 $PY -m pytest tests/test_cuda_ray.py -q -p no:cacheprovider -W ignore
# the bench: each Ray worker, and the trainer actor, on half the GPU; every part fits one GPU (two
# workers beside the trainer in the driver; one worker beside the trainer actor)
TAIL=14 run bench 240 $PY -m rollover.cli bench ray --steps $STEPS --updates $UPDATES --cpus 4 --kill-requests $KILL \
  --gpus-per-worker $GPUS --trainer-actor --json "$OUT/bench_ray.json" device=$DEV $SHRINK
echo "=== done $(date +%T)"
