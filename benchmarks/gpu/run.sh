#!/usr/bin/env bash
# One lease of a lent GPU, in one call: the CUDA tests, the decode step at 512 rows of the
# Qwen2.5-0.5B shape (torch's attention, the Triton kernel, the compiled step), decode-step profiles with admissions
# (the default admit_batch, resumed prefixes, admit_batch 1), `bench april` (long-tail and natural
# lengths), `simulate calibrate --device cuda`, `bench engine` (135M, also through transformers' forward, and a
# Qwen2.5-0.5B-shaped model),
# `bench train` and the demo workload beside TRL's GRPOTrainer, each under its own time limit
# and all under one deadline (the limits add up to more than the default 560 s: the steps run in
# order of what is most wanted, and those past the deadline are skipped), results tarred after
# every step (a cut-off call still returns them). docs/benchmarks.md has the current figures.
#
#   bash benchmarks/gpu/run.sh OUTDIR [SECONDS]     (from the repository root)
#   OLD=.ab_old/src bash benchmarks/gpu/run.sh ...   (first, after the tests: the host-work A/B below)
#
# Needs: python3 with torch (CUDA) and transformers; the rest of rollover's dependencies as
# wheels in .whl/ (pydantic, math-verify, datasets, ...); SmolLM2's config and tokenizer files
# in .gpu/smollm2 (benchmarks/gpu/stand_ins.py builds random-weight models from them: the
# machine reaches no model hub). SMALL=1 shrinks every size, to try the script on a CPU.
# Preparing both, on the machine that holds this checkout (both folders git-ignored there, via
# .git/info/exclude, and carried with the call), for a Python 3.12 x86-64 target:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl pydantic==2.14.4 \
#     pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
#     math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 gguf==0.19.0 \
#     datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 trl==1.16.0
#   mkdir -p .gpu/smollm2 && cp ~/.cache/rollover/models/smollm2-135m-instruct/{config.json,\
#     generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/smollm2/
set -u
OUT=${1:?usage: run.sh OUTDIR [SECONDS]}
DEADLINE=$(( $(date +%s) + ${2:-560} ))
DEV=${DEV:-cuda}
RES=/tmp/gpu-res; rm -rf "$RES"; mkdir -p "$RES" "$OUT"
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 ROLLOVER_CACHE=/tmp/rc TOKENIZERS_PARALLELISM=false
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m rollover.cli "$@"\n' > /tmp/bin/rollover && chmod +x /tmp/bin/rollover
export PATH=/tmp/bin:$PATH
if [ "${SMALL:-0}" = 1 ]; then P=8; NT=16; ROWS=8; AP=2; AS=4; ARW=16; ANT=32; TP=2; TS=4; TNT=16; ST=1; NANO=2;
else P=128; NT=256; ROWS=128; AP=16; AS=8; ARW=256; ANT=256; TP=32; TS=8; TNT=256; ST=3; NANO=256; fi

step() {  # step NAME LIMIT_S COMMAND...: run under min(LIMIT, time left); its log is $RES/NAME.log
  local name=$1 limit=$2; shift 2
  local left=$(( DEADLINE - $(date +%s) - 5 ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then echo "=== $name skipped: ${left}s left"; return; fi
  echo "=== $name (limit ${limit}s) $(date +%T)"
  local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $(( $(date +%s) - t0 ))s"
  tail -n "${TAIL:-14}" "$RES/$name.log" | cut -c1-400
  tar czf "$OUT/results.tgz" -C "$RES" .
  return $rc
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  python3 -c "import torch, transformers, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no cuda')"
  nproc; } > "$RES/env.txt" 2>&1
cat "$RES/env.txt"
if [ "${NO_WHEELS:-0}" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > "$RES/pip.log" 2>&1 || { tail "$RES/pip.log"; exit 1; }
fi
python3 -c "import rollover.cli, rollover.config, rollover.engine.torch_engine, rollover.train.trainer, math_verify, datasets" \
  || { echo "rollover does not import here"; exit 1; }
step stand_ins 90 python3 benchmarks/gpu/stand_ins.py --tokenizer .gpu/smollm2 --cache /tmp/rc --qwen /tmp/qwen05 --device "$DEV" || exit 1

TESTS=tests/test_cuda.py  # the CUDA paths; the CPU-pinned rest is CI's (TESTS_MORE="tests/..." adds files)
TAIL=30 step tests 150 python3 -m pytest $TESTS ${TESTS_MORE:-} -q -n "${WORKERS:-8}" -p no:cacheprovider \
  --timeout 140 -W ignore  # the compiled-decode test compiles first
ENGINE="--dtype bfloat16 --prompts $P --new-tokens $NT --max-rows $ROWS --repeats 2 --device $DEV"
if [ -n "${OLD:-}" ]; then  # host work A/B, alternating: this tree against the rollover package under $OLD (an
  # earlier commit's src, e.g. `git archive REV src/rollover | tar -x -C .ab_old`, then OLD=.ab_old/src)
  PYTHONPATH=/tmp/site:$PWD/$OLD python3 -c "import rollover; print('A/B against', rollover.__file__)"
  PD="python3 benchmarks/gpu/profile_decode.py --rows $ROWS --new-tokens $(( NT / 2 )) --device $DEV --admit --profile-steps 0"
  for r in 1 2; do
    step ab_new_$r 45 $PD --out "$RES/ab_new_$r.txt"
    PYTHONPATH=/tmp/site:$PWD/$OLD step ab_old_$r 45 $PD --out "$RES/ab_old_$r.txt"
  done
  step ab_engine_new 70 rollover bench engine $ENGINE --skip-hf --json "$RES/ab_engine_new.json"
  PYTHONPATH=/tmp/site:$PWD/$OLD step ab_engine_old 70 rollover bench engine $ENGINE --skip-hf --json "$RES/ab_engine_old.json"
fi
# the decode step toward the hardware (issue: the real path on a GPU, item 4): the 0.5B shape at
# 512 rows through CUDA graphs, eager and compiled (inductor's fused kernels inside the graphs)
# alternating in one call
# (the torch attention and the Triton kernel that reads each row's own keys, in turn, then the
# compiled step beside the eager one, in the same call)
E512="--model /tmp/qwen05 --dtype bfloat16 --prompts $(( ROWS * 4 )) --new-tokens $NT --max-rows $(( ROWS * 4 )) \
  --repeats 2 --device $DEV --skip-hf"
step engine_512 70 rollover bench engine $E512 --json "$RES/engine_512.json"
[ "$DEV" = cuda ] && step engine_512_triton 70 rollover bench engine $E512 --attention triton \
  --json "$RES/engine_512_triton.json"
step engine_compile 200 rollover bench engine $E512 --compile-decode both --json "$RES/engine_compile.json"
TRAIN="--steps $ST rollout.prompts_per_step=$TP rollout.samples_per_prompt=$TS rollout.max_new_tokens=$TNT \
  rollout.max_rows=$(( TP * TS )) device=$DEV"
# in order of what the last H100 run (docs/benchmarks.md "Decode on a GPU") left open: the
# admitting decode profile again (6.77 ms a step then; the K/V cache now moves a row in two
# copies), where APRIL resubmit's resumed prefixes spend their time, APRIL itself, then the rest
step profile_admit 50 python3 benchmarks/gpu/profile_decode.py --rows $ROWS --new-tokens $(( NT / 2 )) --device $DEV \
  --admit --out "$RES/profile_admit.txt"
step profile_resumed 50 python3 benchmarks/gpu/profile_decode.py --rows $ROWS --new-tokens $(( NT / 2 )) --device $DEV \
  --admit --resumed --out "$RES/profile_resumed.txt"
step april 130 rollover bench april --workload longtail --steps 6 --warmup 1 --prompts-per-step $AP --samples-per-prompt $AS \
  --max-rows $ARW --max-new-tokens $ANT --repeats 2 --json "$RES/april_longtail.json"
step profile_admit1 50 python3 benchmarks/gpu/profile_decode.py --rows $ROWS --new-tokens $(( NT / 2 )) --device $DEV \
  --admit --admit-batch 1 --out "$RES/profile_admit1.txt"
step april_natural 90 rollover bench april --workload natural --steps 4 --warmup 1 --prompts-per-step $AP \
  --samples-per-prompt $AS --max-rows $ARW --json "$RES/april_natural.json"
step calibrate 90 rollover simulate calibrate --device "$DEV" --out "$RES/sim_135m.json" --debug
step train 70 rollover bench train $TRAIN --json "$RES/train.json"
step engine_0_5b 70 rollover bench engine --model /tmp/qwen05 $ENGINE --skip-hf --json "$RES/engine_0_5b.json"
step engine_135m 70 rollover bench engine $ENGINE --skip-hf --json "$RES/engine_135m.json"
# the same through the model's own transformers forward (what architectures outside Llama / Mistral / Qwen run):
# its cost on a GPU, with no CUDA graphs (docs/models.md)
step engine_135m_transformers 70 rollover bench engine $ENGINE --skip-hf --forward transformers \
  --json "$RES/engine_135m_transformers.json"
# nano-vllm's throughput workload on the 0.5B Qwen shape (256 sequences, 100-1024 tokens in and out; SMALL: 2)
step engine_nanovllm 120 rollover bench engine --model /tmp/qwen05 --workload nanovllm --prompts $NANO --max-rows $NANO \
  --dtype bfloat16 --repeats 1 --device $DEV --json "$RES/engine_nanovllm.json"
[ "$DEV" = cuda ] && step engine_nanovllm_triton 120 rollover bench engine --model /tmp/qwen05 --workload nanovllm \
  --prompts $NANO --max-rows $NANO --dtype bfloat16 --repeats 1 --device $DEV --attention triton \
  --json "$RES/engine_nanovllm_triton.json"
step train_trl 90 rollover bench train --steps $ST device=$DEV --compare trl --json "$RES/train_trl.json"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv > "$RES/env_after.txt" 2>&1
tar czf "$OUT/results.tgz" -C "$RES" .
echo "=== done $(date +%T)"
