import importlib.util, json, statistics, sys, time
def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
old = load("ab_old/scripts/bench_ep.py", "old_bench")
new = load("scripts/bench_ep.py", "new_bench")
res = {"host5": [], "event11": []}
for i in range(6):
    res["host5"].append(old.link_ceiling_gbps())
    reps = new.link_ceiling_reps_gbps()
    res["event11"].append({"median": statistics.median(reps), "min": min(reps), "max": max(reps)})
    print(f"round {i}: host-timed median-of-5 {res['host5'][-1]:.1f}; event median-of-11 {res['event11'][-1]['median']:.1f} "
          f"(reps {res['event11'][-1]['min']:.1f}-{res['event11'][-1]['max']:.1f})", flush=True)
print(json.dumps(res))
