#!/usr/bin/env bash
# One prepared GPU check for the paged-attention kernels, inside ~8 minutes:
#   1. tests/test_kernels.py with the kernels compiled for the GPU (not interpreted):
#      TAXIRANK_KERNEL_INTERPRET=0 makes a run without a visible GPU fail, not pass on CPU;
#   2. bench/kernels.py: decode kernel vs reference (batch x context), two ragged steps,
#      then the whole Llama-3-8B-shaped decode step (random bf16 weights).
# Each part has its own timeout and the next part runs even if one fails or times out;
# the bench rewrites its JSON after every row, so a timeout keeps what finished.
# Results go to $OUT when set (the device tool brings that folder back), else to
# bench/results/gpu_check/ (git-ignored). Exit status: non-zero if any part failed.
#
#   bash bench/gpu_check.sh                 # PYTHON=python3 by default
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DEST=${OUT:-bench/results/gpu_check}
mkdir -p "$DEST"
export PYTHONPATH=.
export TAXIRANK_KERNEL_INTERPRET=0
status=0

part() {  # part NAME SECONDS CMD...: run with a timeout, log to $DEST/NAME.log, keep going
  local name=$1 secs=$2
  shift 2
  echo "== $name (timeout ${secs}s): $*"
  local t0=$SECONDS rc=0
  timeout --signal=INT --kill-after=15 "$secs" "$@" >"$DEST/$name.log" 2>&1 || rc=$?
  tail -n 25 "$DEST/$name.log"
  echo "== $name: exit $rc after $((SECONDS - t0))s"
  if [ "$rc" -ne 0 ]; then status=1; fi
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} >"$DEST/env.txt" 2>&1 || status=1
cat "$DEST/env.txt"

part tests 120 "$PY" -m pytest tests/test_kernels.py -q -p no:cacheprovider --durations=10
part bench_kernels 190 "$PY" bench/kernels.py --require-gpu --skip-step --out "$DEST/kernels.json"
part bench_step 150 "$PY" bench/kernels.py --require-gpu --skip-decode --skip-ragged --out "$DEST/step.json"

echo "gpu_check: results in $DEST (status $status)"
exit "$status"
