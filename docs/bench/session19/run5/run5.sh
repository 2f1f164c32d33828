#!/bin/bash
# Session 19 run 5: the low-latency combine forced at 1024-4096 tokens (bench --low-latency on)
# against the default (range flags there), same tree (HEAD), interleaved.
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=.:tests MORI_JIT_CACHE_DIR=/tmp/mjc
md5sum kernels/ep/*.hpp kernels/platform/*.hpp mori_jit/ops/ep/*.py | sort > $OUT/md5.txt
mkdir -p /tmp/b5
t0=$(date +%s)
{
for i in 1 2; do
  for v in auto on; do
    echo "=== $v$i ($(( $(date +%s)-t0 )) s)"
    timeout 200 python3 scripts/bench_ep.py --iters 50 --legs bf16 --low-latency $v --tokens 1024 2048 4096 --out /tmp/b5/$v$i.json > /tmp/b5/$v$i.log 2>&1
    echo "rc=$?"; tail -3 /tmp/b5/$v$i.log | grep -i "error\|fail\|Traceback" ; python3 dev/summ.py /tmp/b5/$v$i.json
  done
done
echo "=== end ($(( $(date +%s)-t0 )) s)"
} > $OUT/run5.log 2>&1
(cd /tmp/b5 && tar czf $OUT/bench_json.tgz *.json *.log)
