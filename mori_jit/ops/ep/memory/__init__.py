"""The symmetric arena (``arena``: one allocation per op, cut into named regions) and where its
memory comes from (``symm``: torch symmetric memory or CUDA/HIP IPC; ``nvshmem``: NVSHMEM's heap),
with what the ranks learn of each other to choose it (``peers``). Imports only the top files of
``ops/ep``."""
