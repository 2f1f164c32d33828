#!/bin/bash
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MORI_EP_TEST_WORLD_SIZES=1,2,8
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
timeout 120 python3 scripts/bench_overlap.py --world-sizes 1 2 4 --tokens 128 512 4096 --iters 30 --out $OUT/bench_overlap.json > $OUT/b_overlap.log 2>&1; el bench_overlap rc $?; grep "^ws" $OUT/b_overlap.log
PYTHONPATH=. timeout 90 python3 scripts/bench_ep.py --wire --tokens 128 512 1024 2048 4096 8192 > $OUT/b_wire.log 2>&1; el bench_wire rc $?; tail -14 $OUT/b_wire.log
[ -f tests/test_gpu_ep_mask.py ] && { MORI_EP_TEST_WORLD_SIZES=4,8 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_ep_mask.py --durations=5 > $OUT/t_mask.log 2>&1; el mask rc $?; tail -4 $OUT/t_mask.log; }
MORI_EP_TEST_WORLD_SIZES=8 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_ep.py tests/test_gpu_ep_moe.py -k "golden or hip_moe or graph_capture or back_to_back or receive_nothing" > $OUT/t_regress.log 2>&1; el regress rc $?; tail -4 $OUT/t_regress.log
