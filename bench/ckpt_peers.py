#!/usr/bin/env python3
"""The time of a checkpoint: flowrun's per-rank checkpoints (issue 72) against PyTorch's distributed
checkpoint (torch.distributed.checkpoint.save, "DCP"), on the same tensors, in one run.

flowrun   graphs/gpt.yaml by overrides (--layers, --dim, --heads, --vocab, --context; byte shards of
          scripts/data.sh, batch --batch per rank, AdamW, the EMA; evaluation off), run.steps =
          --every x --checkpoints, ckpt.every=--every: what is saved is the model's parameters, the
          AdamW moments, the EMA weights and the data cursor (about 4 x params x 4 bytes). Rank 0
          logs, per checkpoint, `checkpoint DIR/step_N written (T s; W ranks, this one X MB; the
          step waited S s for the snapshot and the write before)`: T is the write (every rank's files fsynced, the
          manifest written, `latest` moved), in the background while training goes on (on the same
          cores); S is the time the training step was blocked (the snapshot copy, and the write before
          if it had not ended: one write is in flight at a time; rank 0's). A run's
          figures: the median over its checkpoints after the first and before the last (written
          while training goes on), and the last one's T apart ("at the end": the one at run.steps,
          written after the last step, nothing else running, as DCP's saves). A write that outlasts
          the steps to the next checkpoint makes that step wait for it (one write in flight; S
          counts it): the script warns when a write took longer than those steps (metrics.jsonl's
          step times); raise --every then. T is logged to 1 ms.
DCP       a torchrun job of gloo ranks on the CPU holding a state dict of the same tensors (their
          names, shapes and dtypes read from that flowrun checkpoint's manifest.json, version 2:
          states.REF.tensors.NAME.shape/dtype; random values), saved --checkpoints times with
          `dcp.save(state_dict, checkpoint_id=FRESH_FOLDER)` (its FileSystemWriter: one file per
          rank, fsynced, --dcp-threads writer threads a rank), a barrier before and after each, the
          folder removed after it (untimed). A run's figure is the median over its saves after the
          first; nothing else runs meanwhile. DCP's torch.save framing adds ~1.5 KB a tensor item
          (a shard is an item): the DCP size column is larger at tiny sizes.
Rows:
  np1    one process (2 threads): flowrun whole tensors; DCP world 1
  dp4    `mpirun -np 4` data parallel (1 thread a rank): every rank holds everything; flowrun cuts
         each replicated tensor among the ranks (each writes about 1/4); DCP world 4 with the same
         replicated plain tensors on every rank (DCP's planner dedups them: each written by one rank)
  zero4  `mpirun -np 4 ... zero.stage=params` (ZeRO-3): each rank holds 1/4 of every tensor and
         writes it; DCP world 4 with each tensor flattened and a DTensor Shard(0) over a 1-D
         DeviceMesh of the 4 gloo ranks (what FSDP2's sharded state dict hands DCP): each rank
         writes its own shards (0-d tensors, the optimizer's step counts, stay replicated)

Rounds alternate flowrun / DCP (flowrun first in even rounds, DCP first in odd ones, the modes in
turn within a round); the table gives medians over rounds with their min–max, and the ratios DCP ÷
flowrun as the median of the rounds' ratios (above 1: flowrun's checkpoint is faster), against
flowrun's writes during training and against its write at the end. Start-up
(process launch, model build, the state dict's creation) is excluded on both sides. The allocator
settings are cpu_peers.py's (this script re-runs itself with them unless --malloc default).
The out dir (default a fresh folder under /tmp) holds both sides' folders; its file system is
printed with the results. The other rounds' flowrun folders and DCP folders are removed as they go.

  .venv/bin/python bench/ckpt_peers.py --quick                  # a smoke test: tiny model, 1 round
  .venv/bin/python bench/ckpt_peers.py --rounds 5               # ~370 MB checkpoints (6 x 512)
  .venv/bin/python bench/ckpt_peers.py --layers 8 --dim 512 --modes np1,dp4 --out-dir /scratch/ck
"""
import argparse
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = {"np1": (1, "none"), "dp4": (4, "none"), "zero4": (4, "params")}
LABELS = {"np1": "np 1", "dp4": "np 4 dp", "zero4": "np 4 ZeRO-3"}

# The checkpoint node's line (nodes/state/checkpoint.cpp), "[rank 0] " before it under mpirun.
WRITTEN = re.compile(r"checkpoint (\S+) written \(([0-9.]+) s; (\d+) ranks?, this one ([0-9.]+) MB; "
                     r"the step waited ([0-9.]+) s for the snapshot and the write before\)")
# A looser reading, should the wording change: the first seconds figure and the waited one.
WRITTEN_LOOSE = re.compile(r"checkpoint (\S+) written \(([0-9.]+) s.*?waited ([0-9.]+) s")


def mpirun(n):
    return ["mpirun", "--oversubscribe", "--bind-to", "none", "--allow-run-as-root", "-np", str(n)]


def du_bytes(path):
    out = subprocess.run(["du", "-sb", path], stdout=subprocess.PIPE, text=True, check=True).stdout
    return int(out.split()[0])


def step_of(folder):
    m = re.search(r"step_0*(\d+)", folder)
    return int(m.group(1)) if m else -1


# ---- flowrun ----

def flowrun_cmd(args, mode, out_dir):
    world, zero = MODES[mode]
    threads = args.threads if world == 1 else 1
    c = args.cfg
    over = ["graphs/gpt.yaml", "data.path=data/text/fortunes_byte", "data.seq_len=%d" % c["context"],
            "data.batch=%d" % args.batch, "model.layers=%d" % c["layers"], "model.dim=%d" % c["dim"],
            "model.heads=%d" % c["heads"], "model.vocab=%d" % c["vocab"], "model.context=%d" % c["context"],
            "zero.stage=%s" % zero, "run.steps=%d" % (args.every * args.checkpoints), "run.log_every=1",
            "ckpt.every=%d" % args.every, "eval.every=1000000", "evlog.every=1000000", "run.threads=%d" % threads,
            "run.progress=off", "run.out_dir=" + out_dir]
    return (mpirun(world) if world > 1 else []) + [args.flowrun] + over


def flowrun_run(args, mode, r):
    """One flowrun run: {write, blocked: medians over its checkpoints after the first; bytes: du -b
    of its last step folder; ranks; manifest: the path of a copy of its last manifest}."""
    out = os.path.join(args.out_dir, "flowrun-%s-r%d" % (mode, r))
    shutil.rmtree(out, ignore_errors=True)
    cmd = flowrun_cmd(args, mode, out)
    env = dict(os.environ, OMPI_MCA_btl_vader_single_copy_mechanism="none")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                       timeout=args.timeout)
    if p.returncode != 0:
        raise RuntimeError("flowrun failed (exit %d): %s\n%s" % (p.returncode, " ".join(cmd), p.stdout[-3000:]))
    rows = []  # (step, T, S, ranks or None, MB or None)
    for line in p.stdout.splitlines():
        m = WRITTEN.search(line)
        if m:
            rows.append((step_of(m.group(1)), float(m.group(2)), float(m.group(5)), int(m.group(3)), float(m.group(4))))
            continue
        m = WRITTEN_LOOSE.search(line)
        if m:
            if not args.loose_seen:
                print("note: flowrun's checkpoint line is not in the expected format; read loosely: " + line.strip(),
                      flush=True)
                args.loose_seen = True
            rows.append((step_of(m.group(1)), float(m.group(2)), float(m.group(3)), None, None))
    rows.sort()
    if len(rows) < 3:
        raise RuntimeError("flowrun logged %d checkpoint line(s), 3 or more needed: %s\n%s"
                           % (len(rows), " ".join(cmd), p.stdout[-3000:]))
    ckdir = os.path.join(out, "checkpoints")
    last = os.path.join(ckdir, open(os.path.join(ckdir, "latest")).read().strip())
    manifest = os.path.join(args.out_dir, "manifest-%s.json" % mode)
    shutil.copyfile(os.path.join(last, "manifest.json"), manifest)
    # When each step ended (rank 0's metrics.jsonl): a write longer than the steps to the next
    # checkpoint made that checkpoint's step wait for it, which S does not count.
    ends = {}
    for line in open(os.path.join(out, "metrics.jsonl")):
        if line.strip():
            row = json.loads(line)
            ends[row["step"]] = row["time"]
    overran = [(a[0], a[1], ends[b[0] - 1] - ends[a[0]]) for a, b in zip(rows, rows[1:])
               if a[0] in ends and b[0] - 1 in ends and a[1] > ends[b[0] - 1] - ends[a[0]]]
    steps = sorted(ends.items())
    per_step = statistics.median((t2 - t1) / (s2 - s1) for (s1, t1), (s2, t2) in zip(steps, steps[1:]))
    mid = rows[1:-1]  # after the first, before the last (run.steps: the end, training over)
    res = {"write": statistics.median(t for _, t, _, _, _ in mid),
           "blocked": statistics.median(s for _, _, s, _, _ in mid),
           "end": rows[-1][1], "step_s": per_step, "overran": overran,
           "bytes": du_bytes(last), "ranks": rows[-1][3], "rank0_mb": rows[-1][4], "manifest": manifest,
           "checkpoints": len(rows), "cmd": " ".join(cmd)}
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return res


# ---- DCP ----

def dcp_cmd(args, mode, r, result):
    world, _ = MODES[mode]
    threads = args.threads if world == 1 else 1
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
            str(free_port()), os.path.abspath(__file__), "--dcp-worker", "--dcp-mode", mode,
            "--dcp-manifest", os.path.join(args.out_dir, "manifest-%s.json" % mode),
            "--dcp-folder", os.path.join(args.out_dir, "dcp-%s-r%d" % (mode, r)), "--dcp-result", result,
            "--checkpoints", str(args.checkpoints), "--dcp-threads", str(args.dcp_threads),
            "--threads", str(threads)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dcp_run(args, mode, r):
    """One torchrun job: {save: the median over its saves after the first; bytes: du -b of a folder}."""
    result = os.path.join(args.out_dir, "dcp-%s-r%d.json" % (mode, r))
    cmd = dcp_cmd(args, mode, r, result)
    env = dict(os.environ, OMP_NUM_THREADS=cmd[cmd.index("--threads") + 1])
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                       timeout=args.timeout)
    if p.returncode != 0:
        raise RuntimeError("DCP job failed (exit %d): %s\n%s" % (p.returncode, " ".join(cmd), p.stdout[-3000:]))
    res = json.load(open(result))
    os.remove(result)
    times = res["times"]
    return {"save": statistics.median(times[1:] if len(times) > 1 else times), "bytes": res["bytes"],
            "cmd": " ".join(cmd)}


def state_shapes(manifest):
    """{ref: {name: (shape, dtype)}} of a flowrun manifest (version 2)."""
    m = json.load(open(manifest))
    if m.get("version") != 2:
        raise SystemExit("%s: manifest version %s, this script reads version 2" % (manifest, m.get("version")))
    return {ref: {name: (t["shape"], t["dtype"]) for name, t in s["tensors"].items()} for ref, s in m["states"].items()}


DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64", "I32": "int32",
          "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def dcp_worker(args):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = args.dcp_mode == "zero4"
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)  # the same values on every rank: replicas are equal
    state = {}
    for ref, tensors in state_shapes(args.dcp_manifest).items():
        sd = state[ref] = {}
        for name, (shape, dtype) in sorted(tensors.items()):
            dt = getattr(torch, DTYPES[dtype])
            t = (torch.randn(shape, generator=g).to(dt) if dt.is_floating_point
                 else torch.randint(0, 1000, shape, generator=g).to(dt))
            if sharded and t.dim() > 0:
                d = distribute_tensor(t.reshape(-1), mesh, [Shard(0)], src_data_rank=None)
                # Its own storage (a view would be saved with the whole tensor's bytes).
                t = DTensor.from_local(d.to_local().clone(), mesh, [Shard(0)], run_check=False, shape=d.shape,
                                       stride=d.stride())
            sd[name] = t
    times, size = [], 0
    for i in range(args.checkpoints):
        folder = "%s-s%d" % (args.dcp_folder, i)
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=FileSystemWriter(folder, thread_count=args.dcp_threads))
        dist.barrier()
        times.append(time.perf_counter() - t0)
        if rank == 0:
            size = du_bytes(folder)
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()
    if rank == 0:
        with open(args.dcp_result, "w") as f:
            json.dump({"times": times, "bytes": size}, f)
    dist.destroy_process_group()


# ---- report ----

def rng(xs, fmt="%.3f"):
    xs = sorted(xs)
    return (fmt + " (" + fmt + "–" + fmt + ")") % (statistics.median(xs), xs[0], xs[-1])


def ratio(num, den):
    r = sorted(n / d for n, d in zip(num, den) if d > 0)
    if not r:
        return "-"
    return "**%.2f x** (%.2f–%.2f)" % (statistics.median(r), r[0], r[-1])


def machine_lines(out_dir):
    import torch

    cpu = "?"
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    df = subprocess.run(["df", "-hT", out_dir], stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()
    mpi = subprocess.run(["mpirun", "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True).stdout.strip().splitlines()[:1]
    return ["machine: %s, %d cores (os.cpu_count), %s, %s" % (cpu, os.cpu_count(), platform.node(), platform.platform()),
            "torch %s (%s); %s" % (torch.__version__, sys.executable, mpi[0] if mpi else "mpirun ?"),
            "disk of the out dir %s:" % out_dir] + ["    " + l for l in df]


def main():
    if "--dcp-worker" not in sys.argv:
        from cpu_peers import same_malloc

        same_malloc()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="np1,dp4,zero4", help="comma-separated: np1, dp4, zero4")
    ap.add_argument("--rounds", type=int, default=None, help="default 5 (--quick: 1)")
    ap.add_argument("--checkpoints", type=int, default=5,
                    help="checkpoints (DCP: saves) a run: the first left out, flowrun's last (at the end) apart")
    ap.add_argument("--every", type=int, default=4, help="flowrun's steps between checkpoints (ckpt.every)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="flowrun's rows a rank a step")
    ap.add_argument("--threads", type=int, default=2, help="threads of the one-process runs (4 ranks: 1 each)")
    ap.add_argument("--dcp-threads", type=int, default=1, help="FileSystemWriter's thread_count (DCP's default: 1)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: 2 layers x 64, vocab 256, 1 round")
    ap.add_argument("--out-dir", default=None, help="where both sides write (default: a new folder under /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep flowrun's run folders")
    ap.add_argument("--flowrun", default="build/engine/flowrun")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per process run")
    ap.add_argument("--malloc", choices=["same", "default"], default="same")
    # the DCP job's ranks (torchrun runs this script with these)
    for a in ("--dcp-mode", "--dcp-manifest", "--dcp-folder", "--dcp-result"):
        ap.add_argument(a, help=argparse.SUPPRESS)
    ap.add_argument("--dcp-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dcp_worker:
        return dcp_worker(args)
    if args.quick:
        args.layers, args.dim, args.heads, args.vocab, args.context = 2, 64, 4, 256, 32
        args.rounds, args.checkpoints, args.every = args.rounds or 1, 3, 5
    args.rounds = args.rounds or 5
    args.cfg = dict(layers=args.layers, dim=args.dim, heads=args.heads, vocab=args.vocab, context=args.context)
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            ap.error("unknown mode %s (np1, dp4, zero4)" % m)
    if args.checkpoints < 3:
        ap.error("--checkpoints: 3 or more (the first is left out, flowrun's last is at the end)")
    args.out_dir = os.path.abspath(args.out_dir or tempfile.mkdtemp(prefix="ckpt-peers-"))
    os.makedirs(args.out_dir, exist_ok=True)
    args.loose_seen = False
    from cpu_peers import same_libtorch

    same_libtorch(args.flowrun)
    c = args.cfg
    params = c["vocab"] * c["dim"] + c["context"] * c["dim"] + c["layers"] * (12 * c["dim"] ** 2 + 13 * c["dim"]) + 2 * c["dim"]
    print("model: %s (~%.1fM parameters; params + AdamW moments + EMA ~%.0f MB), batch %d a rank, %d checkpoints "
          "a run every %d steps, %d rounds; out dir %s" % (", ".join("%s=%s" % kv for kv in c.items()), params / 1e6,
                                                           16 * params / 1e6, args.batch, args.checkpoints, args.every,
                                                           args.rounds, args.out_dir), flush=True)
    fl = {m: [] for m in modes}
    pt = {m: [] for m in modes}
    cmds = {}
    warnings = []
    for r in range(args.rounds):
        for m in modes:
            order = ("flowrun", "dcp") if r % 2 == 0 else ("dcp", "flowrun")  # round 1 reads the shapes
            for side in order:
                if side == "flowrun":
                    res = flowrun_run(args, m, r)
                    fl[m].append(res)
                else:
                    res = dcp_run(args, m, r)
                    pt[m].append(res)
                cmds.setdefault((m, side), res["cmd"])
            f, d = fl[m][-1], pt[m][-1]
            print("round %d %-5s flowrun write %.3f s, blocked %.3f s, at the end %.3f s (%d checkpoints, %s MB on "
                  "rank 0, %.3f s a step), %.1f MB; DCP save %.3f s, %.1f MB"
                  % (r + 1, m, f["write"], f["blocked"], f["end"], f["checkpoints"], f["rank0_mb"], f["step_s"],
                     f["bytes"] / 1e6, d["save"], d["bytes"] / 1e6), flush=True)
            for step, took, window in f["overran"]:
                warnings.append("%s round %d: the write of step %d took %.2f s, longer than the %.2f s of steps to the "
                                "next checkpoint: that step waited for it (counted in `blocked`); raise --every"
                                % (m, r + 1, step, took, window))
                print("warning: " + warnings[-1], flush=True)
    lines = [""] + machine_lines(args.out_dir) + ["", "commands (round 1; later rounds differ only in folder names):"]
    for (m, side), cmd in cmds.items():
        lines.append("  %s %s: %s" % (m, side, ("OMPI_MCA_btl_vader_single_copy_mechanism=none " if side == "flowrun"
                                                and MODES[m][0] > 1 else "") + cmd))
    lines += ["", "model: %s; batch %d a rank; %d rounds of %d checkpoints (DCP: saves) a run, every %d steps; flowrun "
                  "write and blocked: the median over a run's checkpoints after the first and before the last (%d "
                  "while training goes on), at the end: the last (run.steps: training over, as DCP's saves); DCP: "
                  "the median over a run's saves after the first; cells: median over rounds (min–max)"
              % (", ".join("%s=%s" % kv for kv in c.items()), args.batch, args.rounds, args.checkpoints, args.every,
                 args.checkpoints - 2), "",
              "| processes | checkpoint size (flowrun / DCP) | flowrun write s | flowrun blocked s | flowrun write at "
              "the end s | DCP save s | DCP ÷ flowrun write (>1: flowrun faster) | DCP ÷ flowrun at the end | "
              "flowrun write np4 ÷ np1 | flowrun s a step |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    base = statistics.median(x["write"] for x in fl["np1"]) if "np1" in fl else None
    for m in modes:
        w = [x["write"] for x in fl[m]]
        scale = ("%.2f" % (statistics.median(w) / base)) if base and m != "np1" else ("1" if m == "np1" else "-")
        ends = [x["end"] for x in fl[m]]
        lines.append("| %s | %.1f MB / %.1f MB | %s | %s | %s | %s | %s | %s | %s | %.3f |" % (
            LABELS[m], statistics.median(x["bytes"] for x in fl[m]) / 1e6,
            statistics.median(x["bytes"] for x in pt[m]) / 1e6, rng(w), rng([x["blocked"] for x in fl[m]]), rng(ends),
            rng([x["save"] for x in pt[m]]), ratio([x["save"] for x in pt[m]], w),
            ratio([x["save"] for x in pt[m]], ends), scale, statistics.median(x["step_s"] for x in fl[m])))
    if args.loose_seen:
        lines.append("note: flowrun's checkpoint lines were read loosely (not in the expected wording)")
    lines += ["warning: " + w for w in warnings]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    with open(os.path.join(args.out_dir, "report.md"), "w") as f:
        f.write(text)
    for m in modes:
        p = os.path.join(args.out_dir, "manifest-%s.json" % m)
        if os.path.exists(p) and not args.keep:
            os.remove(p)


if __name__ == "__main__":
    main()
