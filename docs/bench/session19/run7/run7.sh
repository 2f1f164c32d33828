#!/bin/bash
# Session 19 run 7: a sender block's flags every 2 tasks after one fence (EpCfg.flagEvery = 2 via
# MORI_V2_EP_COMBINE_FLAGEVERY; the candidate is ../flag_every_candidate.diff) against every task
# (the HEAD binaries), interleaved; measurement only.
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=.:tests MORI_JIT_CACHE_DIR=/tmp/mjc
md5sum kernels/ep/*.hpp kernels/platform/*.hpp mori_jit/ops/ep/*.py | sort > $OUT/md5.txt
mkdir -p /tmp/b7
t0=$(date +%s)
{
echo "=== smoke every 2, m=1024 ($(( $(date +%s)-t0 )) s)"
MORI_V2_EP_COMBINE_FLAGEVERY=2 timeout 60 python3 scripts/ep_smoke.py --hidden 7168 --m 1024 --rounds 4 2>&1 | tail -2
for i in 1 2; do
  for v in 2 1; do
    echo "=== e$v-$i ($(( $(date +%s)-t0 )) s)"
    export MORI_V2_EP_COMBINE_FLAGEVERY=$v
    timeout 60 python3 scripts/bench_ep.py --iters 50 --legs bf16 --tokens 1024 4096 --out /tmp/b7/e$v-$i.json > /tmp/b7/e$v-$i.log 2>&1
    echo "rc=$?"; tail -3 /tmp/b7/e$v-$i.log | grep -i "error\|fail\|Traceback" ; python3 dev/summ.py /tmp/b7/e$v-$i.json
  done
done
echo "=== end ($(( $(date +%s)-t0 )) s)"
} > $OUT/run7.log 2>&1
(cd /tmp/b7 && tar czf $OUT/bench_json.tgz *.json *.log)
