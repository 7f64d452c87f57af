#!/usr/bin/env python3
"""flowrun against what users would run instead, on this machine's CPU, in one run.

Configs (graphs/gpt.yaml by overrides, and the same model in bench/torch_peers.py):
  gpt_bench      4 layers, 256 wide, 4 heads, 128 tokens, byte vocabulary, batch 16, fp32
  fortunes_tiny  the README's: 2 layers, 128 wide, 4 heads, 64 tokens, byte vocabulary, batch 32
  dit_demo       graphs/dit_base.yaml as it is (shapes shards of scripts/data.sh, 32x32, batch
                 32, frozen BERT, DiT 128 wide x 4, EMA every step) against the same loop in
                 bench/torch_dit.py (DataLoader with 1 worker); eager only; also in images/s
Modes:
  eager  one process, --threads intra-op threads: flowrun vs a plain PyTorch loop
  ddp    2 processes on the same cores, global batch as above: `mpirun -np 2 flowrun` (batch
         per rank = half) vs PyTorch DDP (gloo), 1 thread per process
  tp     2 processes of 1 thread, tensor parallel, each running the whole batch:
         `mpirun -np 2 flowrun ... run.parallel.tp=2` vs DTensor's ColwiseParallel /
         RowwiseParallel plans over gloo (torch_peers.tp_round)
  fsdp   2 processes of 1 thread, fully sharded, half the batch each: `mpirun -np 2 flowrun ...
         zero.stage=params` vs FSDP2 (fully_shard per block, then the model) over gloo
         (torch_peers.fsdp_round)
  tp_fsdp  4 processes of 1 thread, dp 2 x tp 2, half the batch a replica: `mpirun -np 4 flowrun
         ... run.parallel.tp=2 zero.stage=params` vs DTensor's plans on the tp dimension inside
         FSDP2 on the dp dimension of a 2-D DeviceMesh (torch_peers.tp_fsdp_round)
  pp_SCHEDULE  2 processes of 1 thread, pipeline parallel, the whole batch in 4 micro-batches
         (SCHEDULE: gpipe, 1f1b, interleaved with 2 chunks a rank, zero_bubble; `pp` = all four):
         `mpirun -np 2 flowrun ... run.parallel.pp=2 run.parallel.schedule=SCHEDULE` vs
         torch.distributed.pipelining's schedule of that name on the same cut (torch_pipeline.py)
  wall   fortunes_tiny only: the README's 600-step command, whole process wall time (start-up,
         evaluation and checkpoints included), against the PyTorch loop's 600 steps (its
         start-up excluded); flowrun's last val_loss beside it (target <= 2.1 nats/byte)
Rounds alternate flowrun / PyTorch; each figure is the median over rounds of per-step medians
(start-up and --warmup steps excluded), and the ratio column gives the median of the rounds'
ratios (flowrun and PyTorch of one round, run one after the other) with their min–max.
Allocator: flowrun keeps freed memory in the process (cli/main.cpp: mallopt of
M_MMAP_THRESHOLD 32 MiB and M_TRIM_THRESHOLD max, the same as the environment variables
MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_); so that the comparison is of the training
code alone, this script re-runs itself with those variables set, which give the PyTorch loop (in
this process, and DDP's workers) the same settings (flowrun leaves them as given).
--malloc default skips that (the peer with glibc's defaults, flowrun with its own). The peer trains on random tokens, flowrun on the
fortunes byte shards of scripts/data.sh: the speed of a step does not depend on the tokens.
Both sides of dit_demo read the same image shards. Run it with the Python whose PyTorch flowrun
was built against (scripts/setup.sh's .venv/, requirements.txt: torch, pillow for dit_demo): the
script checks that this torch's libtorch_cpu is the one the flowrun binary loads, so both sides
run the same libtorch.

  .venv/bin/python bench/cpu_peers.py                         # gpt_bench, eager and ddp
  .venv/bin/python bench/cpu_peers.py --config fortunes_tiny --modes eager,wall
  .venv/bin/python bench/cpu_peers.py --config dit_demo          # eager; data.path data/shapes/base
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_pipeline import pp_round  # noqa: E402
from torch_peers import (ddp_round, eager_round, flowrun_round, fsdp_round, gpt_overrides, loop_seconds,  # noqa: E402
                         tp_fsdp_round, tp_round)

CONFIGS = {
    "gpt_bench": dict(layers=4, dim=256, heads=4, vocab=256, context=128, batch=16, bf16=False),
    "fortunes_tiny": dict(layers=2, dim=128, heads=4, vocab=256, context=64, batch=32, bf16=False),
}


README_FORTUNES = ["graphs/gpt.yaml", "data.path=data/text/fortunes_byte", "model.vocab=256", "model.layers=2",
                   "model.dim=128", "model.heads=4", "model.context=64", "data.seq_len=64", "data.batch=32",
                   "opt.lr=3e-3", "opt.warmup=50", "opt.min_lr=3e-4", "run.steps=600", "ema.decay=0.99",
                   "eval.every=200", "evlog.every=200"]  # README.md, as written there


def readme_run(flowrun):
    """The README's fortunes command: (wall seconds of the whole process, last val_loss)."""
    with tempfile.TemporaryDirectory(prefix="flowrun-bench-") as out:
        cmd = [flowrun] + README_FORTUNES + ["run.out_dir=" + out, "run.progress=off"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        secs = time.perf_counter() - t0
        if p.returncode != 0:
            raise RuntimeError("flowrun failed (exit %d): %s\n%s" % (p.returncode, " ".join(cmd), p.stdout[-3000:]))
        rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
    return secs, [r["val_loss"] for r in rows if "val_loss" in r][-1]


def dit_main(args):
    """dit_demo: flowrun graphs/dit_base.yaml vs bench/torch_dit.py's loop, eager only."""
    from torch_dit import DIT_DEMO, dit_overrides, dit_round, make_dit, param_count  # needs python3-pil: imported here

    if args.modes != "eager":
        sys.exit("dit_demo has mode eager only (not %s)" % args.modes)
    cfg, data = DIT_DEMO, args.data or "data/shapes/base"
    print("DiT parameters (PyTorch loop): %d; flowrun logs its own at start" % param_count(make_dit(cfg["dit"], 0.0)))
    fl, pt = [], []
    for _ in range(args.rounds):
        ov = dit_overrides(cfg, data, args.steps, args.window, threads=args.threads)
        fl.append(flowrun_round(args.flowrun, ov, args.warmup)[0])
        pt.append(dit_round(cfg, data, args.steps, args.warmup, args.window, threads=args.threads))
    f, p = 1 / statistics.median(fl), 1 / statistics.median(pt)
    print("| config | mode | PyTorch steps/s | flowrun steps/s | flowrun / PyTorch, median (min–max) of %d rounds |"
          % args.rounds)
    print("|---|---|---|---|---|")
    print("| %s | eager | %.2f (%.1f images/s) | %.2f (%.1f images/s) | %s |"
          % (args.config, p, p * cfg["batch"], f, f * cfg["batch"], ratio_cell(fl, pt)), flush=True)
    print("allocator: %s" % ("flowrun's settings on both sides (MALLOC_* variables)" if args.malloc == "same"
                             else "glibc's defaults for PyTorch, flowrun's own"))


# flowrun's allocator settings (cli/main.cpp), as glibc's environment variables.
SAME_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(2 ** 31 - 1)}


def same_malloc():
    """Re-run this script with flowrun's allocator settings in the environment (read by glibc at
    start, so they must be there before this process allocates)."""
    if "--malloc" in sys.argv and sys.argv[sys.argv.index("--malloc") + 1:][:1] == ["default"]:
        return
    if all(os.environ.get(k) == v for k, v in SAME_MALLOC.items()):
        return
    os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, **SAME_MALLOC))


def same_libtorch(flowrun):
    """The libtorch_cpu that the flowrun binary loads (ldd) is this Python's torch's: else the
    comparison would be of two PyTorch versions, not of the training code."""
    import torch

    ours = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    # The binary links no libtorch; the library that runs its graphs does (cli/torch_side.hpp).
    runner = os.path.join(os.path.dirname(os.path.abspath(flowrun)), "libflowrun_cli_torch.so")
    out = subprocess.run(["ldd", runner if os.path.exists(runner) else flowrun], stdout=subprocess.PIPE, text=True).stdout
    theirs = [l.split("=>")[1].split()[0] for l in out.splitlines() if "libtorch_cpu.so" in l and "=>" in l]
    if not theirs or os.path.realpath(theirs[0]) != ours:
        sys.exit("cpu_peers.py: %s loads %s, but this Python's torch %s is %s: run this script with the Python "
                 "flowrun was built against (.venv/bin/python)" % (flowrun, theirs[0] if theirs else "no libtorch_cpu",
                                                                     torch.__version__, ours))
    print("same libtorch on both sides: torch %s (%s)" % (torch.__version__, os.path.dirname(ours)), flush=True)


def mpirun(n):
    """The launcher of an n-process flowrun on these cores (as root, Open MPI wants telling)."""
    return ["mpirun", "--oversubscribe", "-np", str(n), "--bind-to", "none"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


def ratio_cell(fl, pt):
    """Median of the rounds' speed ratios flowrun / PyTorch (PyTorch's seconds over flowrun's),
    with their min–max."""
    r = sorted(p / f for f, p in zip(fl, pt))
    return "**%.3f** (%.3f–%.3f)" % (statistics.median(r), r[0], r[-1])


def main():
    same_malloc()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--malloc", choices=["same", "default"], default="same",
                    help="same: the PyTorch side gets flowrun's allocator settings (default); default: glibc's")
    ap.add_argument("--flowrun", default="build/engine/flowrun")
    ap.add_argument("--config", choices=sorted(CONFIGS) + ["dit_demo"], default="gpt_bench")
    ap.add_argument("--modes", default=None, help="default: eager,ddp (dit_demo: eager)")
    ap.add_argument("--data", default=None, help="default: data/text/fortunes_byte (dit_demo: data/shapes/base)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    same_libtorch(args.flowrun)
    if args.config == "dit_demo":
        args.modes = args.modes or "eager"
        return dit_main(args)
    args.modes = args.modes or "eager,ddp"
    args.data = args.data or "data/text/fortunes_byte"
    cfg = CONFIGS[args.config]
    print("| config | mode | PyTorch steps/s | flowrun steps/s | flowrun / PyTorch, median (min–max) of %d rounds |"
          % args.rounds)
    print("|---|---|---|---|---|")
    modes = []
    for mode in args.modes.split(","):
        modes += ["pp_gpipe", "pp_1f1b", "pp_interleaved", "pp_zero_bubble"] if mode == "pp" else [mode]
    for mode in modes:
        fl, pt, vals = [], [], []
        if mode == "eager":
            ov = gpt_overrides(cfg, args.data, args.steps, args.window, "cpu", threads=args.threads)
            sides = [lambda: fl.append(flowrun_round(args.flowrun, ov, args.warmup)[0]),
                     lambda: pt.append(eager_round(cfg, "cpu", args.steps, args.warmup, args.window, threads=args.threads))]
        elif mode == "ddp":
            half = dict(cfg, batch=cfg["batch"] // 2)  # per rank
            ov = gpt_overrides(half, args.data, args.steps, args.window, "cpu", threads=1)
            mpi = mpirun(2)
            sides = [lambda: fl.append(flowrun_round(args.flowrun, ov, args.warmup, launcher=mpi)[0]),
                     lambda: pt.append(ddp_round(cfg, 2, args.steps, args.warmup, args.window, threads=1))]
        elif mode == "tp":
            # Tensor parallel over 2 processes of 1 thread, each running the whole batch: flowrun's
            # run.parallel.tp=2 against DTensor's column/row plans (torch_peers.tp_round).
            ov = gpt_overrides(cfg, args.data, args.steps, args.window, "cpu", threads=1) + ["run.parallel.tp=2"]
            mpi = mpirun(2)
            sides = [lambda: fl.append(flowrun_round(args.flowrun, ov, args.warmup, launcher=mpi)[0]),
                     lambda: pt.append(tp_round(cfg, 2, args.steps, args.warmup, args.window, threads=1))]
        elif mode == "fsdp":
            # Fully sharded over 2 processes of 1 thread, half the batch each: flowrun's
            # zero.stage=params against FSDP2's fully_shard per block (torch_peers.fsdp_round).
            half = dict(cfg, batch=cfg["batch"] // 2)
            ov = gpt_overrides(half, args.data, args.steps, args.window, "cpu", threads=1) + ["zero.stage=params"]
            mpi = mpirun(2)
            sides = [lambda: fl.append(flowrun_round(args.flowrun, ov, args.warmup, launcher=mpi)[0]),
                     lambda: pt.append(fsdp_round(cfg, 2, args.steps, args.warmup, args.window, threads=1))]
        elif mode == "tp_fsdp":
            # Both composed over 4 processes of 1 thread, dp 2 x tp 2, half the batch a replica:
            # flowrun's run.parallel.tp=2 zero.stage=params against DTensor's plans inside FSDP2
            # over a 2-D mesh (torch_peers.tp_fsdp_round, torchtitan's layout).
            half = dict(cfg, batch=cfg["batch"] // 2)
            ov = gpt_overrides(half, args.data, args.steps, args.window, "cpu", threads=1) + ["run.parallel.tp=2",
                                                                                           "zero.stage=params"]
            mpi = mpirun(4)
            sides = [lambda: fl.append(flowrun_round(args.flowrun, ov, args.warmup, launcher=mpi)[0]),
                     lambda: pt.append(tp_fsdp_round(cfg, 4, 2, args.steps, args.warmup, args.window, threads=1))]
        elif mode.startswith("pp_"):
            # Pipeline parallel over 2 processes of 1 thread, the whole batch in 4 micro-batches
            # (torch_pipeline.pp_round: torch.distributed.pipelining's schedule of the same name).
            schedule = mode[3:]
            ov = gpt_overrides(cfg, args.data, args.steps, args.window, "cpu", threads=1) + [
                "run.parallel.pp=2", "run.parallel.microbatches=4", "run.parallel.schedule=" + schedule,
                "run.parallel.virtual_stages=%d" % (2 if schedule == "interleaved" else 1)]
            mpi = mpirun(2)
            sides = [lambda: fl.append(flowrun_round(args.flowrun, ov, args.warmup, launcher=mpi)[0]),
                     lambda: pt.append(pp_round(cfg, 2, schedule, 4, args.steps, args.warmup, args.window, threads=1))]
        elif mode == "wall":
            def flowrun_wall():
                secs, val = readme_run(args.flowrun)
                fl.append(secs)
                vals.append(val)
            sides = [flowrun_wall, lambda: pt.append(loop_seconds(cfg, 600, threads=args.threads))]
        else:
            sys.exit("unknown mode " + mode)
        for r in range(args.rounds):
            # Interleaved: flowrun first in even rounds, PyTorch first in odd ones, so that a
            # machine speeding up or slowing down within a round favours neither side.
            for side in sides if r % 2 == 0 else sides[::-1]:
                side()
        if mode == "wall":
            f, p = statistics.median(fl), statistics.median(pt)
            print("| %s | wall, 600 steps | %.1f s | %.1f s (val_loss %s) | %s |"
                  % (args.config, p, f, " ".join("%.3f" % v for v in vals), ratio_cell(fl, pt)), flush=True)
            continue
        f, p = 1 / statistics.median(fl), 1 / statistics.median(pt)
        print("| %s | %s | %.2f | %.2f | %s |" % (args.config, mode, p, f, ratio_cell(fl, pt)), flush=True)
    print("allocator: %s" % ("flowrun's settings on both sides (MALLOC_* variables)" if args.malloc == "same"
                             else "glibc's defaults for PyTorch, flowrun's own"))


if __name__ == "__main__":
    main()
