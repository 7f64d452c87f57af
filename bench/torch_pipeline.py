"""The pipeline-parallel peer for bench/cpu_peers.py's `pp` mode: bench/torch_peers.py's GPT cut
into stages as torchtitan cuts a model (a module per stage: the embeddings with the first, the
blocks between, the final norm and the head with the last) and trained with
torch.distributed.pipelining's schedules (gloo, CPU): ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B (2 stages a rank), ScheduleInterleavedZeroBubble. torch.distributed.pipelining
has no weights shared between stages, so the last stage's head is a table of its own (flowrun's
GPT ties it to the first stage's embedding and sums the two gradients each step); the clipped norm
is the whole model's (each stage's squares summed over the ranks), as flowrun's.
"""
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_peers import Block, _spawn, make_optimizer

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
             "zero_bubble": "ScheduleInterleavedZeroBubble"}


class Stage(nn.Module):
    def __init__(self, cfg, blocks, first, last):
        super().__init__()
        d = cfg["dim"]
        self.first, self.last = first, last
        if first:
            self.wte = nn.Embedding(cfg["vocab"], d)
            self.wpe = nn.Embedding(cfg["context"], d)
        self.h = nn.ModuleList(Block(d, cfg["heads"]) for _ in range(blocks))
        if last:
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Parameter(torch.empty(cfg["vocab"], d))
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        if last:
            nn.init.normal_(self.head, std=0.02)

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1)))
        for b in self.h:
            x = b(x)
        return self.ln_f(x) @ self.head.t() if self.last else x


def _pp_worker(rank, world, port, cfg, schedule, microbatches, virtual, steps, warmup, window, threads, out):
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    torch.manual_seed(rank)
    chunks = world * virtual
    per = cfg["layers"] // chunks
    mine = [k for k in range(chunks) if k % world == rank]
    modules = [Stage(cfg, per, k == 0, k == chunks - 1) for k in mine]
    stages = [pipelining.PipelineStage(m, k, chunks, torch.device("cpu")) for m, k in zip(modules, mine)]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))

    cls = getattr(pipelining, SCHEDULES[schedule])
    sched = cls(stages if cls.__name__ in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble") else stages[0],
                n_microbatches=microbatches, loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters()]
    holder = nn.Module()
    holder.p = nn.ParameterList(params)
    opt = make_optimizer(holder, "cpu")
    B, T = cfg["batch"], cfg["context"]
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg["vocab"], (8, B, T + 1), generator=g)
    times, t0 = [], None
    for step in range(steps):
        if step == warmup:
            t0 = time.perf_counter()
        batch = data[step % 8]
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # the stages check strides
        losses = []
        first, last = 0 in mine, chunks - 1 in mine
        if first and last:
            sched.step(x, target=y, losses=losses)
        elif first:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        # The whole model's norm: each stage's squares summed over the ranks, then clip.
        sq = torch.stack([p.grad.pow(2).sum() for p in params if p.grad is not None]).sum().reshape(1)
        dist.all_reduce(sq)
        scale = min(1.0, 1.0 / (float(sq.sqrt()) + 1e-6))
        if scale < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup and (step + 1 - warmup) % window == 0:
            t1 = time.perf_counter()
            times.append((t1 - t0) / window)
            t0 = t1
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def pp_round(cfg, world, schedule, microbatches, steps, warmup, window, threads=1):
    """Seconds per step of torch.distributed.pipelining (gloo, CPU) over `world` local processes,
    global batch cfg["batch"] in `microbatches`: rank 0's median over windows after warm-up."""
    virtual = 2 if schedule == "interleaved" else 1
    return _spawn(_pp_worker, world, (cfg, schedule, microbatches, virtual, steps, warmup, window, threads),
                  "pipeline (%s)" % schedule)
