#!/usr/bin/env bash
# The GPU session's runs (issue 31): the CUDA tests, then `multihead bench --device cuda` in parts, all
# inside a deadline. Run from the repository root on the GPU machine, with the wheels of .whl/ carried
# (transformers 5.23 and what it needs newer than the image has). Writes under $OUT (at most 8 files):
# env.txt, tests.log, failures.log (each failure as it happens), bench.log and one JSON per bench part.
# Knobs: BUDGET_S (the deadline), TESTS_S, FIRST_IDS (a file of test ids run first, on their own), GRID_K
# (a -k filter for the main test pass), PARTS (the bench parts, in order), BENCH_FIRST=1 (bench before tests).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/bench
deadline=$(( $(date +%s) + ${BUDGET_S:-560} ))
left() { echo $(( deadline - $(date +%s) )); }
if [ -z "${NO_WHEELS:-}" ]; then  # NO_WHEELS=1: a dry run where the packages are already there
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nproc
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
opts="-p pytest_failure_log"  # xdist and pytest-timeout where the image has them (KINDS.md lists both)
# one test process per 8 GiB of GPU memory, at most 14: 14 on the H100's 80 GB ran three compiled-flex
# float32 grid tests out of memory ("CUDA driver error: out of memory" at kernel launch)
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
workers=$(( ${mem_mib:-81920} / 8192 )); [ "$workers" -gt 14 ] && workers=14; [ "$workers" -lt 1 ] && workers=1
python3 -c "import xdist" 2>/dev/null && opts="$opts -n $workers"
python3 -c "import pytest_timeout" 2>/dev/null && opts="$opts --timeout 150"
export FAILURE_LOG="$OUT/failures.log"
tests() {  # -v: a killed run still shows what passed
  TORCHINDUCTOR_COMPILE_THREADS=1 timeout "$1" python3 -m pytest -p no:cacheprovider $opts -v "${@:2}" >> "$OUT/tests.log" 2>&1
  echo "tests rc=$? $(grep -cE ' PASSED ' "$OUT/tests.log") passed, $(grep -c '^=== ' "$FAILURE_LOG" 2>/dev/null) failed so far, $(left) s left"
}
bench() {
  for part in ${PARTS:-module attention decode mask}; do
    t=$(( $(left) - 5 )); [ "$t" -lt 20 ] && { echo "no time left for bench part $part"; break; }
    timeout "$t" python3 -m multihead bench --device cuda --only "$part" --out "/tmp/bench/$part" --no-progress \
      >> "$OUT/bench.log" 2>&1
    echo "bench $part rc=$? $(left) s left"
    cp "/tmp/bench/$part/cuda.json" "$OUT/cuda_$part.json" 2>/dev/null
  done
}
if [ -n "${FIRST_IDS:-}" ]; then set -f; tests 120 $(cat "$FIRST_IDS"); set +f; fi
[ "${BENCH_FIRST:-0}" = 1 ] && bench
t=$(( $(left) - 5 )); [ "${BENCH_FIRST:-0}" = 1 ] || t=${TESTS_S:-210}
[ "$t" -gt 20 ] && tests "$t" tests/test_cuda.py tests/test_cuda_models.py ${GRID_K:+-k "$GRID_K"}
[ "${BENCH_FIRST:-0}" = 1 ] || bench
grep -E "^\| .*(yes|no)" "$OUT/bench.log" | tail -40
grep '^=== ' "$FAILURE_LOG" 2>/dev/null | head -60
