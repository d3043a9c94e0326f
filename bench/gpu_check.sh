#!/usr/bin/env bash
# The prepared GPU check, within 5 minutes on an H200 (docs/KERNELS.md): five stages, each
# with a time limit (overridable: T_SMOKE=40 bash bench/gpu_check.sh): 1 smoke (both kernels
# vs the references) 35 s, 2 tests (tests/test_kernels.py compiled for real) 45 s, 3 kernels
# (copy bandwidth, decode grid + tuning sweep, ragged steps) 75 s, 4 step (the 8B-shaped
# decode step vs its roofline) 50 s, 5 mix (bench/gpu_mix.py) 80 s. A stage that fails or
# times out does not stop the next; after each, bench/gpu_check_report.py rewrites
# results.json and summary.md and raw.tgz holds every stage's JSON and log, in $OUT when set
# (at most 8 files come back), else bench/results/gpu_check/.
#
#   bash bench/gpu_check.sh               # on a GPU
#   bash bench/gpu_check.sh --cpu-smoke   # here: the same plumbing, interpreted kernels, tiny shapes
set -uo pipefail  # no -e: a failing stage is a result, not the end
cd "$(dirname "$0")/.."

case "$*" in
  "") MODE=gpu ;;
  --cpu-smoke) MODE=cpu-smoke ;;
  *) echo "usage: bash bench/gpu_check.sh [--cpu-smoke], got: $*" >&2; exit 2 ;;
esac
# PYTHON= wins; else the README's virtual environment, when this checkout has one; else PATH's
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
DEST=${OUT:-bench/results/gpu_check}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
mkdir -p "$DEST"
export PYTHONPATH=. PYTHONUNBUFFERED=1
status=0

report() {
  "$PY" bench/gpu_check_report.py "$WORK" "$DEST" --mode "$MODE" || echo "gpu_check: the report failed"
  tar czf "$DEST/raw.tgz" -C "$WORK" . 2>/dev/null || true
}

stage() {  # stage NAME SECONDS CMD...: run with a time limit, log, record, report
  local name=$1 secs=$2
  shift 2
  echo "== $name (limit ${secs}s): $*"
  local t0=$SECONDS rc=0
  timeout --signal=INT --kill-after=10 "$secs" "$@" >"$WORK/$name.log" 2>&1 || rc=$?
  tail -n 30 "$WORK/$name.log"
  echo "== $name: exit $rc after $((SECONDS - t0))s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$secs" >>"$WORK/stages.tsv"
  if [ "$rc" -ne 0 ]; then status=1; fi
  report
}

{
  echo "mode $MODE, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
    --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
  "$PY" -c "import sys, jax, jaxlib
print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  "$PY" -c "import kernels_pallas as kp; print('pallas triton:', kp.triton_unavailable() or 'importable')"
} >"$WORK/env.txt" 2>&1
cat "$WORK/env.txt"
report

if [ "$MODE" = gpu ]; then
  export TAXIRANK_KERNEL_INTERPRET=0
  GPU=--require-gpu
  stage smoke "${T_SMOKE:-35}" "$PY" bench/attention_kernels.py $GPU --smoke --out "$WORK/smoke.json"
  stage tests "${T_TESTS:-45}" "$PY" -m pytest tests/test_kernels.py -m "not hypothesis" -v -rfE \
    -p no:cacheprovider --durations=5
  stage kernels "${T_KERNELS:-75}" "$PY" bench/attention_kernels.py $GPU --sweep --backends pallas --skip-step \
    --contexts 8192,2048,512 --batches 256,64,16,1 --out "$WORK/kernels.json"
  stage step "${T_STEP:-50}" "$PY" bench/attention_kernels.py $GPU --skip-decode --skip-ragged --step-backends pallas \
    --out "$WORK/step.json"
  stage mix "${T_MIX:-80}" "$PY" bench/gpu_mix.py $GPU --out "$WORK/mix.json"
else  # every stage's plumbing on CPU: interpreted kernels, toy shapes
  export TAXIRANK_KERNEL_INTERPRET=1
  stage smoke "${T_SMOKE:-150}" "$PY" bench/attention_kernels.py --quick --smoke --out "$WORK/smoke.json"
  stage tests "${T_TESTS:-150}" "$PY" -m pytest tests/test_kernels.py -m "not hypothesis" -q -rfE \
    -p no:cacheprovider -k "split_k or one_split"
  stage kernels "${T_KERNELS:-150}" "$PY" bench/attention_kernels.py --quick --sweep --backends pallas --skip-step \
    --out "$WORK/kernels.json"
  stage step "${T_STEP:-150}" "$PY" bench/attention_kernels.py --quick --skip-decode --skip-ragged --step-backends xla \
    --out "$WORK/step.json"
  stage mix "${T_MIX:-150}" "$PY" bench/gpu_mix.py --tiny --out "$WORK/mix.json"
fi

# ---- tensor parallelism: TP=1 vs TP=N, only when more than one GPU is visible ----
NGPU=$("$PY" -c "import jax; print(jax.local_device_count() if jax.default_backend() == 'gpu' else 0)" \
  2>/dev/null || echo 0)
if [ "$MODE" = gpu ] && [ "${NGPU:-0}" -gt 1 ]; then
  stage tp "${T_TP:-120}" "$PY" bench/tp.py --tp "1,$NGPU" --requests 32 --prompt-len 512 --max-tokens 64
fi

echo "gpu_check: results in $DEST (summary.md, results.json, raw.tgz; status $status)"
cat "$DEST/summary.md" 2>/dev/null
rm -rf "$WORK"
exit "$status"
