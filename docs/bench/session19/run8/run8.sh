#!/bin/bash
# Session 19 run 8: the flag senders storing rows as relaxed system-scope words (EXPERIMENT:
# flagEvery=2 encodes it) against weak stores (HEAD binaries); measurement only.
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=.:tests MORI_JIT_CACHE_DIR=/tmp/mjc
md5sum kernels/ep/*.hpp kernels/platform/*.hpp mori_jit/ops/ep/*.py | sort > $OUT/md5.txt
mkdir -p /tmp/b8
for v in 2 1; do
  echo "=== e$v"
  MORI_V2_EP_COMBINE_FLAGEVERY=$v timeout 45 python3 scripts/bench_ep.py --iters 50 --legs bf16 --tokens 4096 --out /tmp/b8/e$v.json > /tmp/b8/e$v.log 2>&1
  echo "rc=$?"; tail -3 /tmp/b8/e$v.log | grep -i "error\|fail\|Traceback"; python3 dev/summ.py /tmp/b8/e$v.json
done > $OUT/run8.log 2>&1
