# What benchmarks/gpu/ray.sh and vllm.sh share (sourced, after they set OUT, DEADLINE, DEV and PY).

export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false ROLLOVER_CACHE=${ROLLOVER_CACHE:-/tmp/rc}
mkdir -p "$OUT"

wheels() {  # wheels [PIP_FLAG...]: rollover's own dependencies from .whl/ into /tmp/site (unless NO_WHEELS=1)
  if [ "${NO_WHEELS:-0}" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$@" --target /tmp/site .whl/*.whl \
      > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
  fi
}

run() {  # run NAME LIMIT_S COMMAND...: under min(LIMIT, time left); its log is OUTDIR/NAME.log
  local name=$1 limit=$2 left=$(( DEADLINE - $(date +%s) - 5 )); shift 2
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then echo "=== $name skipped: ${left}s left"; return; fi
  echo "=== $name (limit ${limit}s) $(date +%T)"; local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name rc=$? in $(( $(date +%s) - t0 ))s"; tail -n "${TAIL:-8}" "$OUT/$name.log" | cut -c1-400
}

stand_ins() {  # SmolLM2-135M's random-weight stand-in (and a Qwen2.5-0.5B one) where the cache has no model
  if [ -d .gpu/smollm2 ] && [ ! -d "$ROLLOVER_CACHE/models/smollm2-135m-instruct" ]; then
    run stand_ins 90 $PY benchmarks/gpu/stand_ins.py --tokenizer .gpu/smollm2 --cache "$ROLLOVER_CACHE" \
      --qwen /tmp/qwen05 --device "$DEV"
  fi
}
