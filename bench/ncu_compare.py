#!/usr/bin/env python3
"""Per-step GPU time by kernel family, side by side, from Nsight Compute CSVs (bench/gpu_kernels.py
writes them: `ncu --metrics gpu__time_duration.sum --csv --page raw` over a run of STEPS steps).

  python3 bench/ncu_compare.py out/ncu_flowrun.csv:3 out/ncu_eager.csv:3 out/ncu_compile.csv:3

Each argument is CSV:STEPS (the run's steps; every kernel of the run is counted, start-up
included, and the sums are divided by STEPS). Prints a markdown table: ms per step and kernel
count per family, one column per file, and a total row. A kernel falls in the first family of
FAMILIES whose pattern its name matches (case-insensitive), else "other"; `--names` lists each
family's kernels too, to check the patterns.
"""
import argparse
import collections
import csv
import io
import re
import sys

# (family, pattern over the kernel's name); the first match wins, so the specific ones come first.
FAMILIES = [
    ("compiler-fused (Triton)", r"triton"),  # torch.compile's: whatever it fused, one family
    # flowrun's own loss kernels (nodes/train/cross_entropy_kernels.cu), and the library's
    ("cross-entropy", r"cross_?entropy|softmax|nll_loss|flowrun::.*(forward|backward)_kernel"),
    ("attention", r"flash|fmha|sdpa|attention|cudnn|mha"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|splitk"),
    ("layer norm", r"layer_?norm|GammaBeta"),
    ("fused AdamW", r"adam|FusedOptimizer"),
    ("gradient norm, reductions", r"norm|reduce_kernel|reduction"),
    ("embedding backward (sort, unique, sum)",
     r"radix|unique|scan::|segment|embedding|compute_grad_weight|sum_and_scatter"),
    ("copies and casts", r"copy|CatArray|convert|transpose|gather|scatter"),
    ("fill", r"fill|zero"),
    ("elementwise", r"elementwise|gelu|add|mul|foreach|clamp|reciprocal"),
]
UNITS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,
         "second": 1e3, "s": 1e3}  # to milliseconds


def read(path):
    """[(kernel name, milliseconds)] of one ncu CSV (lines before its header, such as the program's
    own output and ncu's ==PROF== lines, skipped)."""
    text = open(path, errors="replace").read()
    start = text.find('"ID",')
    if start < 0:
        sys.exit("ncu_compare.py: %s has no ncu CSV header (\"ID\",...): did ncu fail? (see its log)" % path)
    rows = list(csv.reader(io.StringIO(text[start:])))
    head, units, body = rows[0], rows[1], rows[2:]
    try:
        name_col, time_col = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
    except ValueError:
        sys.exit("ncu_compare.py: %s lacks a 'Kernel Name' or 'gpu__time_duration.sum' column" % path)
    scale = UNITS.get(units[time_col].strip())
    if scale is None:
        sys.exit("ncu_compare.py: %s: unknown time unit %r" % (path, units[time_col]))
    out = []
    for r in body:
        if len(r) > time_col and r[time_col].strip():
            out.append((r[name_col], float(r[time_col].replace(",", "")) * scale))
    return out


def family(name):
    for fam, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return fam
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="CSV:STEPS")
    ap.add_argument("--names", action="store_true", help="also list each family's kernels (ms per step)")
    args = ap.parse_args()
    cols = []
    for spec in args.runs:
        path, _, steps = spec.rpartition(":")
        if not path or not steps.isdigit() or int(steps) < 1:
            ap.error("%s: expected CSV:STEPS, STEPS a positive integer" % spec)
        ms, count, names = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
        for name, t in read(path):
            f = family(name)
            ms[f] += t / int(steps)
            count[f] += 1
            names[f][name[:90]] += t / int(steps)
        cols.append((path.rsplit("/", 1)[-1].replace("ncu_", "").replace(".csv", ""), int(steps), ms, count, names))
    fams = [f for f, _ in FAMILIES] + ["other"]
    fams = [f for f in fams if any(c[2][f] for c in cols)]
    print("| family | " + " | ".join("%s: ms/step (kernels)" % c[0] for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for f in sorted(fams, key=lambda f: -cols[0][2][f]):
        print("| %s | %s |" % (f, " | ".join("%.2f (%d)" % (c[2][f], round(c[3][f] / c[1])) for c in cols)))
    print("| total | %s |" % " | ".join("**%.2f** (%d)" % (sum(c[2].values()), round(sum(c[3].values()) / c[1]))
                                         for c in cols))
    if args.names:
        for c in cols:
            print("\n## %s" % c[0])
            for f in fams:
                for name, t in c[4][f].most_common(8):
                    print("%-28s %7.3f  %s" % (f, t, name))


if __name__ == "__main__":
    sys.exit(main())
