#!/usr/bin/env python3
"""The cost model of `flowrun plan` against measured runs (issue 50; docs/parallel.md "How good
the predictions are").

For each process count N (default 1, 2, 4) on this machine:
  1. the links: `mpirun -np N flowrun plan --measure-links` (N > 1);
  2. the plan: `flowrun plan GRAPH TINY --devices N --global-batch B --links ... --table T`, which
     profiles the graph's model here and predicts every layout of N processes;
  3. every layout that fits, run as the plan writes it: `mpirun -np N flowrun GRAPH TINY
     OVERRIDES run.steps=S run.trace=...`, in --rounds rounds (each round every layout once, in
     the plan's order): the same run on this machine varies by 10-30 % from one process to the next
     (a shared virtual machine), so a layout's step is the median over every round's steps (rank 0's
     trace, from one forward_backward start to the next, each run's first two steps left out);
     memory comes from the second pass (--memory);
then the predicted against the measured: the step time's error (median and worst, %), Spearman's
rank correlation of the two orders, the memory's error. Prints a markdown table per N and a
summary; --json keeps every figure.

--memory: a second pass over the tables the first wrote in --work, for memory alone: each layout
and its 16-wide twin again, 4 steps, with MALLOC_MMAP_THRESHOLD_=131072 (large blocks handed back
to the system when freed, so the resident peak is what was live: flowrun's own setting keeps freed
memory in the process for speed, docs/distributed.md), the twin's own estimate added back (its
logits are not negligible).

  python3 bench/plan_validation.py --flowrun build/engine/flowrun [--np 1 2 4] [--steps 10]

Run it on an idle machine (every figure is a time), with address-space randomisation off, which
on this machine takes the spread of one process's speed from about 25 % to about 8 % (the same
model's block: 6.3 to 8.1 ms from one process to the next, 7.5 to 8.1 ms without):

  setarch -R python3 bench/plan_validation.py ...
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

TINY = ["data.path=data/text/fortunes_byte", "data.seq_len=64", "model.layers=4", "model.dim=256",
        "model.heads=4", "model.vocab=256", "model.context=64"]
BASELINE = ["model.dim=16"]  # the same run, its model's memory negligible (50 KB)


def mpirun(n):
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(n)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd


def run(cmd, log, env=None):
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMPI_MCA_btl_vader_single_copy_mechanism": "none", **(env or {})}).returncode
    if rc != 0:
        sys.exit(f"failed ({rc}): {' '.join(cmd)}\n--- {log}:\n" + open(log).read()[-3000:])
    return open(log).read()


def step_periods(trace, fb, skip=2):
    """The periods from one forward_backward start to the next, after `skip` steps."""
    events = json.load(open(trace))["traceEvents"]
    starts = sorted(e["ts"] for e in events if e.get("ph") == "X" and e.get("name") == fb and e.get("cat") != "mark")
    return [(b - a) * 1e-6 for a, b in zip(starts, starts[1:])][skip:]


def peak_above_start(log):
    """The fullest rank's peak resident memory above its start, bytes."""
    found = [float(x) * 1e9 for x in re.findall(r"peak resident memory [0-9.e+]+ GB \(([0-9.e+-]+) GB above the start\)", log)]
    if not found:
        sys.exit("no 'peak resident memory ... above the start' in the run's log")
    return max(found)


def estimate(log):
    """The fullest rank's memory estimate (forward_backward's line), bytes."""
    unit = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    found = [float(v) * unit[u] for v, u in re.findall(r"memory per rank \(estimate\):.*?= ([0-9.]+) (B|KB|MB|GB);", log)]
    return max(found) if found else 0.0


def memory_pass(a, work):
    live = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    summary = []
    for n in a.np:
        table = [x for x in json.load(open(f"{work}/table{n}.json"))["layouts"] if x["fits"]]
        rows = []
        for i, l in enumerate(table):
            out = f"{work}/mem{n}_{i}"
            cmd = ([] if n == 1 else mpirun(n)) + [a.flowrun, a.graph, *TINY, *l["overrides"], "run.steps=4",
                                                   f"run.out_dir={out}", "run.progress=off", "eval.every=1000000",
                                                   "evlog.every=1000000", "ckpt.every=1000000", "ckpt.at=[]"]
            mine = peak_above_start(run(cmd, f"{out}.log", live))
            twin = run(cmd + BASELINE + [f"run.out_dir={out}b"], f"{out}b.log", live)
            measured = mine - peak_above_start(twin) + estimate(twin)
            rows.append((l, measured))
            print(f"  {l['layout']:<64} predicted {l['memory']['total']/1e6:7.1f} MB  measured {measured/1e6:7.1f} MB", flush=True)
        err = [abs(l["memory"]["total"] - m) / m for l, m in rows]
        summary.append((n, len(rows), statistics.median(err), max(err), sum(e <= 0.15 for e in err)))
        print(f"\n### memory, np {n}\n\n| layout | predicted MB | measured MB | error |\n|---|---:|---:|---:|")
        for (l, m), e in zip(rows, err):
            print(f"| {l['layout']} | {l['memory']['total']/1e6:.1f} | {m/1e6:.1f} | {100*e:.0f} % |")
        print(flush=True)
    print("\n| np | layouts | memory error median | worst | within 15 % |\n|---:|---:|---:|---:|---:|")
    for n, k, med, worst, within in summary:
        print(f"| {n} | {k} | {100*med:.1f} % | {100*worst:.0f} % | {within}/{k} |")


def ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(a, b):
    if len(a) < 3:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va > 0 and vb > 0 else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flowrun", default="build/engine/flowrun")
    ap.add_argument("--graph", default="graphs/gpt.yaml")
    ap.add_argument("--fb", default="fb", help="the graph's forward_backward node")
    ap.add_argument("--np", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--global-batch", type=int, nargs="+", default=[8, 8, 4],
                    help="rows a step, one per --np (fewer rows at np 4: fewer layouts to run)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every layout this many times; from 2 on, the rounds are also ranked against each other "
                         "(how well the measurement reproduces its own order: the most a prediction can reach)")
    ap.add_argument("--sample", type=int, default=0,
                    help="run only this many of the layouts that fit, spread evenly over the plan's order (0: all)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--work", default=None, help="folder for logs, traces and tables (default: a temporary one)")
    ap.add_argument("--memory", action="store_true", help="the memory pass over --work's tables (see above)")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="plan-validation-")
    os.makedirs(work, exist_ok=True)
    if a.memory:
        return memory_pass(a, work)
    print(f"logs, traces and tables in {work}", flush=True)
    everything = {}
    summary = []
    for n, gb in zip(a.np, a.global_batch):
        plan = [a.flowrun, "plan", a.graph, *TINY, "--devices", str(n), "--global-batch", str(gb),
                "--table", f"{work}/table{n}.json", "--top", "200"]
        if n > 1:
            run(mpirun(n) + [a.flowrun, "plan", "--measure-links", "--out", f"{work}/links{n}.json"], f"{work}/links{n}.log")
            plan += ["--links", f"{work}/links{n}.json"]
        print(run(plan, f"{work}/plan{n}.log"), flush=True)
        table = json.load(open(f"{work}/table{n}.json"))["layouts"]
        fitting = [x for x in table if x["fits"]]
        if 0 < a.sample < len(fitting):
            fitting = [fitting[i * len(fitting) // a.sample] for i in range(a.sample)]
        periods = [[] for _ in fitting]
        per_round = [[0.0] * len(fitting) for _ in range(a.rounds)]  # each round's median a layout
        for round_ in range(a.rounds):
            for i, l in enumerate(fitting):
                out = f"{work}/run{n}_{i}"
                cmd = ([] if n == 1 else mpirun(n)) + [a.flowrun, a.graph, *TINY, *l["overrides"], f"run.steps={a.steps}",
                                                       f"run.out_dir={out}", f"run.trace={out}/trace.json",
                                                       "run.progress=off", "eval.every=1000000", "evlog.every=1000000",
                                                       "ckpt.every=1000000", "ckpt.at=[]"]
                t0 = time.time()
                log = run(cmd, f"{out}.log")
                mine = step_periods(f"{out}/trace.json", a.fb)
                periods[i] += mine
                per_round[round_][i] = statistics.median(mine)
                print(f"  round {round_ + 1}  {l['layout']:<64} predicted {l['step_s']*1e3:8.1f} ms  measured "
                      f"{statistics.median(mine)*1e3:8.1f} ms  ({time.time()-t0:.0f} s)", flush=True)
        rows = [{**l, "measured_step_s": statistics.median(p)} for l, p in zip(fitting, periods)]
        err = [abs(r["step_s"] - r["measured_step_s"]) / r["measured_step_s"] for r in rows]
        rho = spearman([r["step_s"] for r in rows], [r["measured_step_s"] for r in rows])
        s = {"np": n, "layouts": len(rows), "median_step_error": statistics.median(err), "worst_step_error": max(err),
             "spearman": rho}
        if a.rounds >= 2:  # the measurement against itself: round 1's order and median difference against round 2's
            r1, r2 = per_round[0], per_round[1]
            s["rounds_spearman"] = spearman(r1, r2)
            s["rounds_median_difference"] = statistics.median(abs(x - y) / ((x + y) / 2) for x, y in zip(r1, r2))
        summary.append(s)
        everything[n] = rows
        print(f"\n### np {n}\n\n| layout | predicted ms | measured ms | error |\n|---|---:|---:|---:|")
        for r, e in sorted(zip(rows, err), key=lambda x: x[0]["measured_step_s"]):
            print(f"| {r['layout']} | {r['step_s']*1e3:.1f} | {r['measured_step_s']*1e3:.1f} | {100*e:.0f} % |")
        print(flush=True)
    print("\n| np | layouts | step error median | worst | Spearman | round 1 vs 2: Spearman | median difference |\n"
          "|---:|---:|---:|---:|---:|---:|---:|")
    for s in summary:
        rounds = (f"{s['rounds_spearman']:.2f} | {100*s['rounds_median_difference']:.1f} %" if "rounds_spearman" in s
                  else "- | -")
        print(f"| {s['np']} | {s['layouts']} | {100*s['median_step_error']:.1f} % | {100*s['worst_step_error']:.0f} % | "
              f"{s['spearman']:.2f} | {rounds} |")
    pooled = [r for n in everything for r in everything[n]]
    if len(a.np) > 1 and pooled:
        err = [abs(r["step_s"] - r["measured_step_s"]) / r["measured_step_s"] for r in pooled]
        print(f"\nall {len(pooled)} layouts together: step error median {100*statistics.median(err):.1f} %, "
              f"Spearman {spearman([r['step_s'] for r in pooled], [r['measured_step_s'] for r in pooled]):.2f}")
    if a.json:
        json.dump({"summary": summary, "layouts": everything}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
