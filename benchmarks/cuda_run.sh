#!/usr/bin/env bash
# The GPU session's one shot (issue 31): the CUDA tests, then `multihead bench --device cuda` in parts, all
# inside a deadline. Run from the repository root on the GPU machine, with the wheels of .whl/ carried
# (transformers 5.23 and what it needs newer than the image has). Writes under $OUT (at most 8 files):
# env.txt, tests.log, junit.xml, bench.log and one JSON per bench part (merged here afterwards).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/bench
deadline=$(( $(date +%s) + ${BUDGET_S:-560} ))
left() { echo $(( deadline - $(date +%s) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD/src || exit 1
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nproc
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# 1. correctness: the CUDA grid and the model-level CUDA tests (-v: a killed run still shows what passed)
opts=""  # xdist and pytest-timeout where the image has them (it should: KINDS.md lists both)
python3 -c "import xdist" 2>/dev/null && opts="$opts -n 12"
python3 -c "import pytest_timeout" 2>/dev/null && opts="$opts --timeout 150"
TORCHINDUCTOR_COMPILE_THREADS=1 timeout ${TESTS_S:-210} python3 -m pytest -p no:cacheprovider $opts -v -rfE \
  tests/test_cuda.py tests/test_cuda_models.py --junitxml="$OUT/junit.xml" > "$OUT/tests.log" 2>&1
echo "tests rc=$? $(grep -cE ' PASSED ' "$OUT/tests.log") passed, $(grep -cE ' FAILED |ERROR ' "$OUT/tests.log") failed/errors, $(left) s left"
grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | head -40
# 2. the bench, in parts (each part's JSON survives a later part's timeout)
for part in module attention decode mask; do
  t=$(( $(left) - 5 )); [ "$t" -lt 20 ] && { echo "no time left for bench part $part"; break; }
  timeout "$t" python3 -m multihead bench --device cuda --only "$part" --out "/tmp/bench/$part" --no-progress \
    >> "$OUT/bench.log" 2>&1
  echo "bench $part rc=$? $(left) s left"
  cp "/tmp/bench/$part/cuda.json" "$OUT/cuda_$part.json" 2>/dev/null
done
grep -E "^\| .*(yes|no)" "$OUT/bench.log" | tail -30
