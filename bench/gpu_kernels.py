#!/usr/bin/env python3
"""Where a GPT-2 124M training step spends its GPU time, per kernel, for flowrun and for the
PyTorch eager loop of bench/gpu_gpt2.py: each runs `--steps` steps (start-up included, so both
sides run the same number of steps) under Nsight Compute,

  ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw

and the CSVs land in `--out` (ncu_flowrun.csv, ncu_eager.csv, ncu_compile.csv: the loop with its
model under torch.compile, compilation's own kernels included). It then prints them summed by
kernel family with bench/ncu_compare.py (the bench/README.md table is made so).

  python3 bench/gpu_kernels.py --flowrun build-gpu/engine/flowrun --out build-gpu/gpu-results
"""
import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_peers import gpt_overrides  # noqa: E402  (bench/torch_peers.py)

# application-only: not torch.compile's compile workers (they launch no kernels of the step)
NCU = ["--clock-control", "none", "--target-processes", "application-only", "--metrics", "gpu__time_duration.sum",
       "--csv", "--page", "raw"]
LOOP = """import sys; sys.path.insert(0, "bench")
from torch_peers import eager_round
eager_round(dict(layers=12, dim=768, heads=12, vocab=50304, context=1024, batch=%d, bf16=True), "cuda", %d, 0, %d,
            compile_it=%s)
"""


def profile(ncu, cmd, csv):
    with open(csv, "w") as f:
        p = subprocess.run([ncu] + NCU + cmd, stdout=f, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        print("ncu failed (exit %d) on %s:\n%s" % (p.returncode, " ".join(cmd), p.stderr[-2000:]), file=sys.stderr)
    return p.returncode


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flowrun", default="build-gpu/engine/flowrun")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--data", default="data/text/fortunes_gpt2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="build-gpu/gpu-results")
    ap.add_argument("--sides", default="flowrun,eager,compile", help="which runs to profile (comma-separated)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg = dict(layers=12, dim=768, heads=12, vocab=50304, context=1024, batch=args.batch, bf16=True)
    rc = 0
    sides = args.sides.split(",")
    if "flowrun" in sides:
        with tempfile.TemporaryDirectory(prefix="flowrun-ncu-") as out:
            cmd = [args.flowrun] + gpt_overrides(cfg, args.data, args.steps, args.steps, "cuda") + \
                  ["run.out_dir=" + out, "run.progress=off"]
            rc |= profile(args.ncu, cmd, os.path.join(args.out, "ncu_flowrun.csv"))
    for side in ("eager", "compile"):
        if side in sides:
            code = LOOP % (args.batch, args.steps, args.steps, side == "compile")
            rc |= profile(args.ncu, [sys.executable, "-c", code], os.path.join(args.out, "ncu_%s.csv" % side))
    csvs = ["%s/ncu_%s.csv:%d" % (args.out, side, args.steps) for side in sides]
    print("ncu tables: " + " ".join(csvs), flush=True)
    p = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ncu_compare.py")] + csvs)
    return 1 if rc or p.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
