"""One line per point of bench JSONs: disp, comb fresh/buffer, link %, D+C, queued phases."""
import json, sys
for path in sys.argv[1:]:
    d = json.load(open(path))
    print(f"== {path} ceil {d['link_ceiling_gbps']:.1f}")
    for r in d["results"]:
        g, z = r["hip_graph"], r.get("hip_graph_zerocopy", {})
        ceil = r.get("link_ceiling_gbps", d["link_ceiling_gbps"])
        rb = r["bytes"]["combine_remote"]
        pct = lambda us: 100 * rb / (us * 1e-6) / (ceil * 1e9)
        dp = 100 * r["bytes"]["dispatch_remote"] / (g["dispatch_us"] * 1e-6) / (ceil * 1e9)
        print(f"  {r['leg']} n={r['tokens']}: disp {g['dispatch_us']:.1f} ({dp:.1f}%) comb {g['combine_us']:.1f}/"
              f"{z.get('combine_us', float('nan')):.1f} ({pct(g['combine_us']):.1f}%) D+C {g['dispatch_us'] + g['combine_us']:.1f}")
        q = r.get("phases_queued_us", {})
        print("   q: " + "; ".join(f"{k[:24]} {v:.1f}" for k, v in q.items() if k.startswith("comb")))
