#!/bin/bash
# device batch A: the split legs (intranode + internode), the fp8 wire, profiles and benches
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MORI_EP_TEST_WORLD_SIZES=1,2,8
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
el start
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_ep_overlap.py --durations=5 > $OUT/t_overlap.log 2>&1; el overlap rc $?; tail -4 $OUT/t_overlap.log
timeout 130 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_ep_combine_quant.py --durations=5 > $OUT/t_fp8.log 2>&1; el fp8 rc $?; tail -4 $OUT/t_fp8.log
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_ep_internode.py -k split --durations=5 > $OUT/t_netsplit.log 2>&1; el netsplit rc $?; tail -4 $OUT/t_netsplit.log
timeout 60 python3 prof_train.py > $OUT/prof.log 2>&1; el prof rc $?
