"""The README's EP example as a program: a toy MoE layer whose tokens go to their top-k experts'
ranks (dispatch), through the experts there, and back home summed (combine).

    torchrun --nproc-per-node 2 scripts/ep_example.py          # CPU: the torch backend on gloo
    torchrun --nproc-per-node 2 scripts/ep_example.py --gpu    # GPU: the hip kernels on NCCL, a GPU per rank

The part between the ``README`` markers is the README's example, line for line
(``tests/test_readme_example.py`` holds them equal and runs this file on two gloo ranks). After it,
every rank computes the same layer densely for its own tokens and compares; rank 0 prints
``ep_example: OK ...`` when every rank's result matches, and the program exits 1 when one does not.
"""
# --- README: begin ---
import os
import sys

import torch
import torch.distributed as dist

from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp

gpu = "--gpu" in sys.argv  # GPU: the hip kernels on NCCL; else the torch backend on gloo (CPU)
if gpu:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if gpu else "gloo")  # torchrun sets the rank, world size and address
rank, ws = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda") if gpu else torch.device("cpu")

H, M, E, K = 512, 64, 4, 2  # hidden size, tokens per rank, experts per rank, top-k
# The experts: ws * E matrices [H, H], the same on every rank (one seed); this rank holds ids
# [rank * E, rank * E + E).
experts = torch.randn(ws * E, H, H, generator=torch.Generator().manual_seed(0)) / H ** 0.5
mine = experts[rank * E:(rank + 1) * E].to(dev)

# This rank's tokens and its router's choice: top-k weights (float32) and expert ids (int32).
gen = torch.Generator().manual_seed(1 + rank)
x = torch.randn(M, H, generator=gen).to(dev, torch.bfloat16)  # [M, H]
w, idx = torch.randn(M, ws * E, generator=gen).softmax(-1).topk(K)  # [M, K] each
w, idx = w.to(dev), idx.to(dev, torch.int32)

cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M,
                              num_experts_per_rank=E, num_experts_per_token=K, data_type=torch.bfloat16,
                              kernel_backend="hip" if gpu else "torch")
with EpDispatchCombineOp(cfg) as op:  # collective (group None: the default group); hip compiles here
    out, out_w, _, out_idx, total_recv, routing = op.dispatch(x, w, None, idx, return_routing=True)
    n = int(total_recv)  # rows [0, n) of out are the tokens this rank received (int() syncs the host)
    # Each received token through the local experts its top-k names, weighted here: combine only sums.
    local = out_idx[:n].long() - rank * E  # [n, K]; an id outside [0, E) is another rank's expert
    expert_out = torch.zeros(n, H, device=dev)
    for e in range(E):
        weight = (out_w[:n] * (local == e)).sum(1, keepdim=True)  # [n, 1]: expert e's top-k weight, or 0
        expert_out += weight * (out[:n].float() @ mine[e])
    y, _ = op.combine(expert_out.to(torch.bfloat16), routing=routing)  # [M, H]: the layer's output
# --- README: end ---

# The check: the same layer computed densely for this rank's tokens, in float32.
ref = torch.zeros(M, H)
for j in range(K):
    ref += w[:, j:j + 1].cpu() * torch.einsum("th,thg->tg", x.float().cpu(), experts[idx[:, j].long().cpu()])
err = (y.float().cpu() - ref).abs()
ok = bool((err <= 2e-2 + 2e-2 * ref.abs()).all())  # bf16 rows: two roundings on the way
flags = torch.tensor([int(ok)], device=dev)  # (NCCL reduces device tensors)
dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank learns whether every rank matched
if not ok:
    print(f"ep_example: rank {rank}: combine differs from the dense layer (max |err| {err.max().item():.3g})",
          file=sys.stderr, flush=True)
if rank == 0 and flags.item():
    print(f"ep_example: OK: {ws} ranks, {op.cfg.backend()} backend, {M} tokens per rank, top-{K} of {ws * E} "
          f"experts: combine matches the dense layer (rank 0 max |err| {err.max().item():.3g})", flush=True)
dist.destroy_process_group()
sys.exit(0 if flags.item() else 1)
