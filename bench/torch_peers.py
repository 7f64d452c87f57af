"""What users would run instead of flowrun, for the benchmarks in bench/: a GPT training loop
written as a PyTorch user writes it (HF GPT-2 layout, SDPA where torch has it, AdamW with GPT-2's
decay groups, clip 1.0), eager or under DDP, and a driver that runs a flowrun graph and reads
its per-step times. Imported by bench/gpu_gpt2.py (GPU) and bench/cpu_peers.py (CPU).

Per-step times exclude start-up: the median over windows of `window` steps after `warmup`
steps, with one host sync per window (a trainer logging its loss), as flowrun's metrics node
syncs once per logged step.
"""
import json
import os
import re
import statistics
import subprocess
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---- the PyTorch peer: GPT-2 as users write it (nanoGPT / HF layout) ----

class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def attn(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, d, h, vocab, context):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.h:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied head, as GPT-2
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def make_optimizer(model, device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    kw = {"lr": 6e-4, "betas": (0.9, 0.95), "eps": 1e-8}
    if device == "cuda":
        kw["fused"] = True
    return torch.optim.AdamW(groups, **kw)


def timed_steps(fwd, model, opt, cfg, device, steps, warmup, window, rank=0):
    """Trains `steps` steps on seeded random tokens; seconds per step, one per window."""
    B, T = cfg["batch"], cfg["context"]
    g = torch.Generator().manual_seed(1 + rank)
    data = torch.randint(0, cfg["vocab"], (8, B, T + 1), generator=g).to(device)
    amp = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=cfg["bf16"])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, t0 = [], None
    for step in range(steps):
        if step == warmup:
            sync()
            t0 = time.perf_counter()
        batch = data[step % 8]
        with amp:
            loss = fwd(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup and (step + 1 - warmup) % window == 0:
            loss.item()  # a trainer logs its loss: one host sync per window, as flowrun's metrics
            sync()
            t1 = time.perf_counter()
            times.append((t1 - t0) / window)
            t0 = t1
    return times


def make_model(cfg, device):
    torch.manual_seed(0)
    return GPT(cfg["layers"], cfg["dim"], cfg["heads"], cfg["vocab"], cfg["context"]).to(device)


def eager_round(cfg, device, steps, warmup, window, compile_it=False, threads=None):
    """Seconds per step of a plain loop: the median over windows after warm-up."""
    if threads:
        torch.set_num_threads(threads)
    model = make_model(cfg, device)
    fwd = torch.compile(model) if compile_it else model
    return statistics.median(timed_steps(fwd, model, make_optimizer(model, device), cfg, device, steps, warmup, window))


def loop_seconds(cfg, steps, threads=None):
    """Wall seconds of a plain loop's `steps` steps on the CPU, first step to last (model and
    data made before the clock starts; the loop's own warm-up steps included, as a run has them)."""
    if threads:
        torch.set_num_threads(threads)
    model = make_model(cfg, "cpu")
    t0 = time.perf_counter()
    timed_steps(model, model, make_optimizer(model, "cpu"), cfg, "cpu", steps, 0, steps)
    return time.perf_counter() - t0


def _ddp_worker(rank, world, port, cfg, steps, warmup, window, threads, out):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    local = dict(cfg, batch=cfg["batch"] // world)  # the global batch split over the ranks
    model = make_model(local, "cpu")
    ddp = DDP(model)
    times = timed_steps(ddp, model, make_optimizer(model, "cpu"), local, "cpu", steps, warmup, window, rank)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def ddp_round(cfg, world, steps, warmup, window, threads=1):
    """Seconds per step of PyTorch DDP (gloo, CPU) over `world` local processes, global batch
    cfg["batch"]: rank 0's median over windows after warm-up."""
    return _spawn(_ddp_worker, world, (cfg, steps, warmup, window, threads), "DDP")


def _spawn(worker, world, args, what):
    """Runs worker(rank, world, port, *args, queue) in `world` spawned processes; rank 0's result."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port) + tuple(args) + (out,)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError("a %s process failed (exit codes %s)" % (what, [p.exitcode for p in procs]))
    return out.get()


# ---- the fully sharded peer: FSDP2 (torch.distributed.fsdp.fully_shard) ----

def _fsdp_worker(rank, world, port, cfg, steps, warmup, window, threads, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    local = dict(cfg, batch=cfg["batch"] // world)  # the global batch split over the ranks, as DDP
    model = make_model(local, "cpu")
    for b in model.h:  # each block its own unit, then the rest (torchtitan's order)
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    times = timed_steps(model, model, make_optimizer(model, "cpu"), local, "cpu", steps, warmup, window, rank)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def fsdp_round(cfg, world, steps, warmup, window, threads=1):
    """Seconds per step of FSDP2 (fully_shard per block, gloo, CPU) over `world` local processes,
    global batch cfg["batch"]: rank 0's median over windows after warm-up."""
    return _spawn(_fsdp_worker, world, (cfg, steps, warmup, window, threads), "FSDP2")


# ---- the tensor-parallel peer: DTensor's column/row plans (torch.distributed.tensor.parallel) ----

class TpBlock(Block):
    """Block with q, k and v as three Linears, so that ColwiseParallel splits each by heads (a
    fused q|k|v split by columns would give rank 0 all of q and half of k); attention runs on the
    heads of this rank's columns (torchtitan does the same with its n_heads per rank)."""

    def __init__(self, d, h):
        super().__init__(d, h)
        del self.c_attn
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.tp = 1

    def attn(self, x):
        B, T, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        C = q.size(-1)  # this rank's columns: h / tp heads
        q, k, v = (t.view(B, T, self.h // self.tp, C * self.tp // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class TpGPT(GPT):
    def __init__(self, layers, d, h, vocab, context):
        super().__init__(layers, d, h, vocab, context)
        self.h = nn.ModuleList(TpBlock(d, h) for _ in range(layers))
        self.apply(self._init)


class TpAdamW:
    """AdamW (GPT-2's decay groups) over the DTensor parameters and over the plain ones: a foreach
    kernel takes one kind, so two optimizers, stepped together."""

    def __init__(self, model):
        from torch.distributed.tensor import DTensor

        def groups(dtensor):
            ps = [p for p in model.parameters() if isinstance(p, DTensor) == dtensor]
            return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                    {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]
        kw = {"lr": 6e-4, "betas": (0.9, 0.95), "eps": 1e-8}
        self.opts = [torch.optim.AdamW(groups(True), **kw), torch.optim.AdamW(groups(False), **kw)]

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def tp_clip_grad_norm_(params, max_norm):
    """clip_grad_norm_ over a tensor-parallel model: torch's refuses DTensor and plain gradients
    together. The split gradients' local squares summed with one all-reduce, the replicated ones
    counted once."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    grads = [p.grad for p in params if p.grad is not None]
    sharded = [isinstance(g, DTensor) and any(isinstance(pl, Shard) for pl in g.placements) for g in grads]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    sq = torch.zeros(())
    for g, s in zip(local, sharded):  # the split ones first, summed over the ranks
        if s:
            sq += g.float().pow(2).sum()
    dist.all_reduce(sq)
    for g, s in zip(local, sharded):  # the replicated ones once
        if not s:
            sq += g.float().pow(2).sum()
    coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return sq.sqrt()


def _tp_worker(rank, world, port, cfg, steps, warmup, window, threads, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = TpGPT(cfg["layers"], cfg["dim"], cfg["heads"], cfg["vocab"], cfg["context"])
    for b in model.h:
        parallelize_module(b, mesh, {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                     "c_proj": RowwiseParallel(), "c_fc": ColwiseParallel(),
                                     "mlp_proj": RowwiseParallel()})
        b.tp = world
    torch.nn.utils.clip_grad_norm_ = tp_clip_grad_norm_  # timed_steps clips through it (this process only)
    times = timed_steps(model, model, TpAdamW(model), cfg, "cpu", steps, warmup, window, rank=0)  # the same batch on every rank
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def tp_round(cfg, world, steps, warmup, window, threads=1):
    """Seconds per step of DTensor tensor parallel (gloo, CPU) over `world` local processes, each
    running the whole batch cfg["batch"]: rank 0's median over windows after warm-up."""
    return _spawn(_tp_worker, world, (cfg, steps, warmup, window, threads), "tensor-parallel")


# ---- both composed: DTensor tensor parallel inside FSDP2 over a 2-D mesh (torchtitan's layout) ----

class MeshAdamW(TpAdamW):
    """AdamW (GPT-2's decay groups) with one optimizer per mesh the parameters live on: a foreach
    kernel takes DTensors of one mesh (the blocks' split layers on dp x tp, the rest on dp)."""

    def __init__(self, model):
        by_mesh = {}
        for p in model.parameters():
            by_mesh.setdefault(p.device_mesh.ndim, []).append(p)
        kw = {"lr": 6e-4, "betas": (0.9, 0.95), "eps": 1e-8}
        self.opts = [torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                                        {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}], **kw)
                     for ps in by_mesh.values()]


def mesh_clip_grad_norm_(params, max_norm):
    """clip_grad_norm_ over FSDP2 x TP DTensors of two meshes (torch's refuses a mix): every
    gradient is sharded over dp; the local squares of those split over tp too summed over the
    world, of the others over dp only (each tp rank holds the same), one all-reduce each."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    grads = [p.grad for p in params if p.grad is not None]
    both, dp_only = torch.zeros(()), torch.zeros(())
    dp_group = None
    for g in grads:
        sq = g.to_local().float().pow(2).sum()
        if g.device_mesh.ndim == 2 and isinstance(g.placements[1], Shard):
            both += sq
        else:
            dp_only += sq
            dp_group = g.device_mesh.get_group(0)  # dimension 0 is dp on both meshes
    dist.all_reduce(both)
    dist.all_reduce(dp_only, group=dp_group)
    norm = (both + dp_only).sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return norm


def _tp_fsdp_worker(rank, world, port, tp, cfg, steps, warmup, window, threads, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))  # tp ranks neighbours
    local = dict(cfg, batch=cfg["batch"] // (world // tp))  # the global batch split over the replicas
    torch.manual_seed(0)
    model = TpGPT(local["layers"], local["dim"], local["heads"], local["vocab"], local["context"])
    for b in model.h:
        parallelize_module(b, mesh["tp"], {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                           "c_proj": RowwiseParallel(), "c_fc": ColwiseParallel(),
                                           "mlp_proj": RowwiseParallel()})
        b.tp = tp
    for b in model.h:  # each block its own unit, then the rest (torchtitan's order)
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    torch.nn.utils.clip_grad_norm_ = mesh_clip_grad_norm_  # timed_steps clips through it (this process only)
    # The tp ranks of a replica read the same rows: seeded by replica.
    times = timed_steps(model, model, MeshAdamW(model), local, "cpu", steps, warmup, window, rank=rank // tp)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def tp_fsdp_round(cfg, world, tp, steps, warmup, window, threads=1):
    """Seconds per step of FSDP2 x DTensor tensor parallel (gloo, CPU) over `world` local processes
    as dp (world / tp) x tp, global batch cfg["batch"]: rank 0's median over windows after warm-up."""
    return _spawn(_tp_fsdp_worker, world, (tp, cfg, steps, warmup, window, threads), "FSDP2 x tensor-parallel")


# ---- flowrun ----

def gpt_overrides(cfg, data, steps, window, device, threads=0):
    """graphs/gpt.yaml as the peers' loop: same model, batch and optimizer settings; the EMA,
    evaluation and checkpoints, which the loop does not have, moved past the last step."""
    return ["graphs/gpt.yaml", "data.path=" + data, "data.batch=%d" % cfg["batch"],
            "data.seq_len=%d" % cfg["context"], "model.layers=%d" % cfg["layers"], "model.dim=%d" % cfg["dim"],
            "model.heads=%d" % cfg["heads"], "model.vocab=%d" % cfg["vocab"], "model.context=%d" % cfg["context"],
            "run.steps=%d" % steps, "run.log_every=%d" % window, "eval.every=1000000", "evlog.every=1000000",
            "ckpt.every=1000000", "ckpt.at=[]", "ema.every=1000000", "run.device=" + device,
            "run.precision=" + ("bf16" if cfg["bf16"] else "fp32"), "run.threads=%d" % threads]


def run_flowrun(flowrun, overrides, launcher=(), timeout=None):
    """One flowrun run in a fresh run.out_dir: (its command line, exit code, output, the rows of
    its metrics.jsonl). `launcher`: a prefix such as mpirun's for a multi-process run (rank 0
    writes the metrics); `timeout`: seconds (subprocess.TimeoutExpired past it)."""
    with tempfile.TemporaryDirectory(prefix="flowrun-bench-") as out:
        cmd = list(launcher) + [flowrun] + overrides + ["run.out_dir=" + out, "run.progress=off"]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        path = os.path.join(out, "metrics.jsonl")
        rows = [json.loads(l) for l in open(path) if l.strip()] if os.path.exists(path) else []
    return " ".join(cmd), p.returncode, p.stdout, rows


def seconds_per_step(rows, first_step=0):
    """The median seconds per step between consecutive logged losses from step `first_step` on
    (metrics.jsonl rows); None with fewer than two."""
    rows = [r for r in rows if "loss" in r and r["step"] >= first_step]
    per_step = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(rows, rows[1:])]
    return statistics.median(per_step) if per_step else None


def tail(text, n=30):
    return "\n".join(text.rstrip().splitlines()[-n:])


def flowrun_timed(flowrun, overrides, warmup, timeout):
    """One flowrun run: (seconds per step, the median of its logged windows after `warmup` steps:
    steps warmup+1 .. warmup+window, ...; its output; its command line). A failure raises
    RuntimeError with the last 30 lines of the output."""
    try:
        cmd, code, output, rows = run_flowrun(flowrun, overrides, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise RuntimeError("timed out after %d s: %s\n%s" % (timeout, " ".join(e.cmd), tail(text)))
    if code != 0:
        raise RuntimeError("exit %d: %s\n%s" % (code, cmd, tail(output)))
    sec = seconds_per_step(rows, warmup)  # the row of step `warmup` opens the first window
    if sec is None:
        raise RuntimeError("logged too few steps after warm-up: %s\n%s" % (cmd, tail(output)))
    return sec, output, cmd


def peak_memory(output, resident=False):
    """The peak memory flowrun's end-of-run line gives ("12.3 GB"): the device's (CUDA), else with
    `resident` the process's peak resident memory; None where it has none."""
    m = re.search(r"peak cuda:\d+ memory ([0-9.]+ [KMGTP]?B)", output) or \
        (resident and re.search(r"peak resident memory ([0-9.]+ [KMGTP]?B)", output))
    return m.group(1) if m else None


# ---- reports ----

def rounds_ratio(num, den):
    """Median (min–max) of the rounds' num / den, over the rounds that have both, for a table."""
    r = sorted(n / d for n, d in zip(num, den) if n is not None and d is not None)
    if not r:
        return "-"
    return "**%.3f x** (%.3f–%.3f, %d rounds)" % (statistics.median(r), r[0], r[-1], len(r))


def ms_range(secs):
    """'median ms (min–max)' of per-round seconds, for a table cell."""
    if not secs:
        return "-"
    ms = sorted(1e3 * s for s in secs)
    return "%.1f ms (%.1f–%.1f)" % (statistics.median(ms), ms[0], ms[-1])


def write_report(out, lines):
    """The lines as one text, written to `out` too (its folder made) unless out is None."""
    text = "\n".join(lines) + "\n"
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text)
    return text


GEMM_SEEN = set()


def note_gemm(output):
    """Print, once each, which library flowrun's float32 products went through (run.cpu_gemm):
    its run log's line at the start and auto's summary at the end."""
    for line in output.splitlines():
        for mark in ("float32 linear layers multiply through ", "run.cpu_gemm auto: "):
            if mark in line:
                said = mark + line.split(mark, 1)[1].strip()
                if said not in GEMM_SEEN:
                    GEMM_SEEN.add(said)
                    print("flowrun: " + said, flush=True)


def flowrun_round(flowrun, overrides, warmup, launcher=()):
    """Seconds per step from OUT_DIR/metrics.jsonl: median of the logged windows after warmup.
    `launcher`: a prefix such as mpirun's for a multi-process run (rank 0 writes the metrics)."""
    cmd, code, output, rows = run_flowrun(flowrun, overrides, launcher)
    if code != 0:
        raise RuntimeError("flowrun failed (exit %d): %s\n%s" % (code, cmd, output[-3000:]))
    note_gemm(output)
    sec = seconds_per_step(rows, warmup + 1)
    if sec is None:
        raise RuntimeError("flowrun logged too few steps after warm-up")
    return sec, cmd
