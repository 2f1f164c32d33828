"""The Markdown table and the PNG of a ``scripts/bench_ep.py`` results file (``--report`` rebuilds
them alone): the derived columns (algorithm bandwidth, link share, ratios to the baselines) are
computed here from the raw times."""
from __future__ import annotations

import json
import os

__all__ = ["report"]


def report(path: str) -> str:
    """Markdown table (and a PNG next to the JSON) from a results file."""
    data = json.load(open(path))
    ceil = data["link_ceiling_gbps"]
    sm = data.get("sm_link_rates") or {}
    reps = data.get("link_ceiling_reps_gbps") or []
    lines = [f"Link ceiling (1 GiB GPU0→GPU1 copy, same run): **{ceil:.0f} GB/s**"
             + (f" (median of {len(reps)} event-timed copies, {min(reps):.0f}-{max(reps):.0f})" if reps else "")
             + ("; SM-driven peer traffic: " + ", ".join(f"{k[3:-5]} {v:.0f}" for k, v in sm.items()) + " GB/s"
                if sm else ""), "",
             "| leg | tok/rank | mode | dispatch µs | combine µs | disp algo GB/s | disp link % | comb link % "
             "| disp × torch | comb × torch | disp × a2a | comb × a2a |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        if "hip_graph" not in r:
            continue
        t, a = r.get("torch_eager"), r.get("nccl_a2a")
        geo = f" {r['geometry']['blocks']}x{r['geometry']['dispatch_warps']}" if "geometry" in r else ""
        for mode in ("hip_eager", "hip_eager_buffer", "hip_graph", "hip_graph_buffer", "torch_eager", "nccl_a2a"):
            if mode not in r:
                continue
            d, c = r[mode]["dispatch_us"], r[mode]["combine_us"]
            b = r["bytes"]
            lines.append(
                f"| {r['leg']} | {r['tokens']}{geo} | {mode} | {d:.1f} | {c:.1f} | {b['dispatch_algo'] / d / 1e3:.0f} | "
                f"{100 * b['dispatch_remote'] / d / 1e3 / ceil:.0f} | {100 * b['combine_remote'] / c / 1e3 / ceil:.0f} | "
                + (f"{t['dispatch_us'] / d:.2f} | {t['combine_us'] / c:.2f} |" if t else "– | – |")
                + (f" {a['dispatch_us'] / d:.2f} | {a['combine_us'] / c:.2f} |" if a else " – | – |"))
        # A dispatch waits for the peer's previous combine, so the bench's back-to-back legs trade time
        # with the ranks' relative phase; their sum is the steadier figure.
        g = r["hip_graph"]
        lines.append(f"| {r['leg']} | {r['tokens']}{geo} | hip_graph dispatch + combine | "
                     f"{g['dispatch_us'] + g['combine_us']:.1f} | | | | | | | | |")
        for mode in ("hip_graph", "hip_graph_buffer"):
            if "per_rank_us" in r.get(mode, {}):
                lines.append(f"| {r['leg']} | {r['tokens']}{geo} | {mode}, every rank's medians (dispatch / combine) | "
                             + "; ".join(f"rank {i} {d:.1f} / {c:.1f}" for i, (d, c) in enumerate(r[mode]["per_rank_us"]))
                             + " | | | | | | | | | |")
        for key, what in (("phases_us", "phases"), ("phases_queued_us", "phases, queued")):
            if key in r:
                lines.append(f"| {r['leg']} | {r['tokens']} | {what} (µs from kernel start) | "
                             + "; ".join(f"{k} {v:.1f}" for k, v in r[key].items()) + " | | | | | | | | | |")
        if "graph_floor_us" in r:
            lines.append(f"| {r['leg']} | {r['tokens']} | floor: 1-kernel graph | {r['graph_floor_us']:.1f} | | | | | | | | |")
        if "host_overhead_us" in r:
            h = r["host_overhead_us"]
            lines.append(f"| {r['leg']} | {r['tokens']} | host overhead | {h['dispatch']:.1f} | {h['combine']:.1f} |"
                         + (f" (out=: {h['combine_out']:.1f})" if "combine_out" in h else "")
                         + (f" (one torch.empty: {h['torch_empty']:.1f})" if "torch_empty" in h else "")
                         + " | | | | | | |")
    md = "\n".join(lines)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(2, 2, figsize=(12, 9))
        for li, leg in enumerate(sorted({r["leg"] for r in data["results"]})):
            rs = [r for r in data["results"] if r["leg"] == leg and "geometry" not in r]
            xs = [r["tokens"] for r in rs]
            for mode in ("hip_eager", "hip_graph", "hip_graph_buffer", "torch_eager", "nccl_a2a"):
                if all(mode in r for r in rs) and rs:
                    for col, key, bkey in ((0, "dispatch_us", "dispatch_remote"), (1, "combine_us", "combine_remote")):
                        ax[0][col].plot(xs, [r[mode][key] for r in rs], marker="o", label=f"{leg} {mode}")
                        ax[1][col].plot(xs, [100 * r["bytes"][bkey] / r[mode][key] / 1e3 / ceil for r in rs],
                                        marker="o", label=f"{leg} {mode}")
        for col, name in ((0, "dispatch"), (1, "combine")):
            ax[0][col].set(xscale="log", yscale="log", xlabel="tokens per rank", ylabel="µs", title=f"{name} latency")
            ax[1][col].set(xscale="log", xlabel="tokens per rank", ylabel="% of link ceiling",
                           title=f"{name} link utilisation")
            ax[1][col].axhline(85, ls="--", lw=0.8, color="gray", label="85 % of the ceiling")
        ticks = sorted({r["tokens"] for r in data["results"]})
        for a in ax.flat:  # the measured sizes as plain labels (a log axis's minor labels collide)
            a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            a.set_xticks(ticks, [str(t) for t in ticks])
        # one legend for the four panels, below them (inside, it covered the lines)
        handles, labels = ax[1][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)
    except ImportError:
        md += "\n\n(matplotlib missing: no plot)"
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(md + "\n")
    return md
