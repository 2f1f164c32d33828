import os, sys, time
import torch
sys.path.insert(0, "scripts")
from mori_jit.testing.distributed import run_distributed

def _job(rank, ws, tokens):
    from torch.profiler import profile, ProfilerActivity
    from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp, train
    H, K, E = 7168, 8, 32
    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=tokens,
                                  num_experts_per_rank=E, num_experts_per_token=K, data_type=torch.bfloat16,
                                  routing_replay=True, kernel_backend="hip", index_dtype=torch.int64)
    out = open(os.path.join(os.environ["OUT"], "prof.txt"), "w")
    with EpDispatchCombineOp(cfg) as op:
        dev, h = op.device, train.register(op)
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.rand(tokens, K, device=dev, generator=g)
        ids = torch.rand(tokens, E, device=dev, generator=g).topk(K, -1).indices
        cot = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16, generator=g)
        def forward(backward=False):
            xs, ws_ = x.detach().requires_grad_(backward), w.detach().requires_grad_(backward)
            d = train.dispatch(h, xs, ws_, ids)
            y, _ = train.combine(h, d.out, d)
            if backward:
                (y * cot).sum().backward()
        def packed():
            xs, ws_ = x.detach().requires_grad_(), w.detach().requires_grad_()
            d = train.dispatch(h, xs, ws_, ids)
            lay = train.pack(d, rank, E, 128)
            y = train.combine_packed(h, lay.mask(lay.x) * lay.weights[:, None].to(lay.x.dtype), lay, d)
            (y * cot).sum().backward()
        for name, fn in (("forward", forward), ("train", lambda: forward(True)), ("packed", packed)):
            for _ in range(3): fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter(); fn(); t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
            out.write(f"== {name}: host {1e6*(t1-t0):.0f} us, total {1e6*(t2-t0):.0f} us\n")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                fn(); torch.cuda.synchronize()
            out.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=25) + "\n")
            out.write(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15) + "\n")
    out.close()

if __name__ == "__main__":
    run_distributed(_job, 1, 4096, timeout=300, backend="nccl", gpus=1)
