#!/bin/bash
# Session 19 run 3: is the release (MEMBAR.SYS) what slows the bulk senders? relaxed flags (5: G2, 6: G3; timing only)
# encoding: COMBINE_BULKMINTOKENS=G) against the wave senders, same tree, interleaved.
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=.:tests MORI_JIT_CACHE_DIR=/tmp/mjc
md5sum kernels/ep/*.hpp kernels/platform/*.hpp mori_jit/ops/ep/*.py | sort > $OUT/md5.txt
mkdir -p /tmp/b3
t0=$(date +%s)
{
for g in 2 6; do
echo "=== smoke bulk G$g m=1024 ($(( $(date +%s)-t0 )) s)"
MORI_V2_EP_COMBINE_BULKMINTOKENS=$g timeout 120 python3 scripts/ep_smoke.py --hidden 7168 --m 1024 --rounds 4 2>&1 | tail -2
done
for i in 1 2; do
  for v in 0 2 5 6; do
    echo "=== g$v-$i ($(( $(date +%s)-t0 )) s)"
    if [ $v != 0 ]; then export MORI_V2_EP_COMBINE_BULKMINTOKENS=$v; else unset MORI_V2_EP_COMBINE_BULKMINTOKENS; fi
    timeout 200 python3 scripts/bench_ep.py --iters 50 --legs bf16 --tokens 1024 4096 --out /tmp/b3/g$v-$i.json > /tmp/b3/g$v-$i.log 2>&1
    echo "rc=$?"; tail -3 /tmp/b3/g$v-$i.log | grep -i "error\|fail\|Traceback" ; python3 dev/summ.py /tmp/b3/g$v-$i.json
  done
done
unset MORI_V2_EP_COMBINE_BULKMINTOKENS
echo "=== end ($(( $(date +%s)-t0 )) s)"
} > $OUT/run3.log 2>&1
tar czf $OUT/json.tgz -C /tmp/b3 .
