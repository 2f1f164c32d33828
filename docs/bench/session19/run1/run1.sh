#!/bin/bash
# Session 19 run 1: bulk-copy combine senders (env) against the wave senders, same tree, interleaved.
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=.:tests MORI_JIT_CACHE_DIR=/tmp/mjc
md5sum kernels/ep/*.hpp kernels/platform/*.hpp mori_jit/ops/ep/*.py | sort > $OUT/md5.txt
mkdir -p /tmp/b
t0=$(date +%s)
{
echo "=== smoke bulk m=1024 ($(( $(date +%s)-t0 )) s)"
MORI_V2_EP_COMBINE_BULKMINTOKENS=1 timeout 120 python3 scripts/ep_smoke.py --hidden 7168 --m 1024 --rounds 4 2>&1 | tail -4
for i in 1 2 3; do
  for v in base bulk; do
    echo "=== $v$i ($(( $(date +%s)-t0 )) s)"
    if [ $v = bulk ]; then export MORI_V2_EP_COMBINE_BULKMINTOKENS=1; else unset MORI_V2_EP_COMBINE_BULKMINTOKENS; fi
    timeout 200 python3 scripts/bench_ep.py --iters 50 --legs bf16 fp8 --tokens 512 1024 2048 4096 --out /tmp/b/$v$i.json > /tmp/b/$v$i.log 2>&1
    echo "rc=$?"; tail -3 /tmp/b/$v$i.log | grep -i "error\|fail\|Traceback" ; python3 dev/summ.py /tmp/b/$v$i.json
  done
done
unset MORI_V2_EP_COMBINE_BULKMINTOKENS
echo "=== end ($(( $(date +%s)-t0 )) s)"
} > $OUT/run1.log 2>&1
tar czf $OUT/json.tgz -C /tmp/b .
