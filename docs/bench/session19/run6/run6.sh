#!/bin/bash
# Session 19 run 6: the flag wave (EpCfg.flagWarp, default on for EP2 range-flag combines on sm_90)
# against it off (MORI_V2_EP_COMBINE_FLAGWARP=0, the HEAD binaries), interleaved; the full bench and
# EP2 GPU tests on the default tree.
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=.:tests MORI_JIT_CACHE_DIR=/tmp/mjc
md5sum kernels/ep/*.hpp kernels/platform/*.hpp mori_jit/ops/ep/*.py tests/test_gpu_ep.py | sort > $OUT/md5.txt
mkdir -p /tmp/b6
t0=$(date +%s)
{
echo "=== smoke m=1024 ($(( $(date +%s)-t0 )) s)"
timeout 100 python3 scripts/ep_smoke.py --hidden 7168 --m 1024 --rounds 4 2>&1 | tail -2
for i in 1 2; do
  for v in fw off; do
    echo "=== $v$i ($(( $(date +%s)-t0 )) s)"
    if [ $v = off ]; then export MORI_V2_EP_COMBINE_FLAGWARP=0; else unset MORI_V2_EP_COMBINE_FLAGWARP; fi
    timeout 150 python3 scripts/bench_ep.py --iters 50 --legs bf16 fp8 --tokens 512 1024 2048 4096 --out /tmp/b6/$v$i.json > /tmp/b6/$v$i.log 2>&1
    echo "rc=$?"; tail -3 /tmp/b6/$v$i.log | grep -i "error\|fail\|Traceback" ; python3 dev/summ.py /tmp/b6/$v$i.json
  done
done
unset MORI_V2_EP_COMBINE_FLAGWARP
echo "=== full bench ($(( $(date +%s)-t0 )) s)"
timeout 150 python3 scripts/bench_ep.py --out $OUT/bench_ep.json > $OUT/bench.log 2>&1
echo "bench rc=$?"; python3 dev/summ.py $OUT/bench_ep.json
echo "=== tests ($(( $(date +%s)-t0 )) s)"
timeout 200 python3 -m pytest -m gpu tests/test_gpu_ep.py tests/test_gpu_axpy.py -q -p no:cacheprovider -rs > $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/tests.log
echo "=== end ($(( $(date +%s)-t0 )) s)"
} > $OUT/run6.log 2>&1
(cd /tmp/b6 && tar czf $OUT/bench_json.tgz *.json *.log)
