#!/bin/bash
# Session 19 run 4: the committed tree (HEAD): EP2 GPU tests (the bulk test's drop and all-to-one
# rounds run for the first time), smoke, and the full bench (host cost of the alignment check).
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=.:tests MORI_JIT_CACHE_DIR=/tmp/mjc
md5sum kernels/ep/*.hpp kernels/platform/*.hpp mori_jit/ops/ep/*.py tests/test_gpu_ep.py | sort > $OUT/md5.txt
t0=$(date +%s)
{
echo "=== smoke ($(( $(date +%s)-t0 )) s)"
timeout 120 python3 scripts/ep_smoke.py --hidden 7168 --m 128 --rounds 4 2>&1 | tail -2
echo "=== tests ($(( $(date +%s)-t0 )) s)"
timeout 280 python3 -m pytest -m gpu tests/test_gpu_ep.py tests/test_gpu_axpy.py -q -p no:cacheprovider -rs > $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -5 $OUT/tests.log
echo "=== bench ($(( $(date +%s)-t0 )) s)"
timeout 200 python3 scripts/bench_ep.py --out $OUT/bench_ep.json > $OUT/bench.log 2>&1
echo "bench rc=$?"; python3 dev/summ.py $OUT/bench_ep.json
echo "=== end ($(( $(date +%s)-t0 )) s)"
} > $OUT/run4.log 2>&1
