#!/usr/bin/env python3
"""GPU benchmarks of flowrun against what users would run instead, in one run.

GPT-2 124M (12 layers, 768 wide, 12 heads, 1024 tokens, vocab 50304, bf16 autocast with fp32
master weights, AdamW, clip 1.0):
  - flowrun: `flowrun graphs/gpt.yaml` with run.device=cuda run.precision=bf16 (EMA, eval and
    checkpoints moved out of the way by overrides), tokens/s from its metrics.jsonl;
  - eager: a plain PyTorch training loop of the same model (HF GPT-2 layout, SDPA, fused AdamW);
  - compile: the same loop under torch.compile (reported beside it, not the headline).
Rounds alternate flowrun / eager; each round's per-step time is the median over windows of
`--window` steps after `--warmup` steps (start-up excluded); the table gives medians over
rounds, the ratio flowrun / eager and model FLOPs utilization (MFU) against the bf16 matmul
peak measured here (best of a few 8192^3 products).

DiT (`--dit`): graphs/dit_base.yaml with a heavy text encoder (BERT 12 x 768) on the GPU,
images/s with the encoder on its own stream (`text.stream=encode`, prefetch 4) against inline
(`text.stream=default`, prefetch 0), alternating rounds.

Usage (tests/gpu/run.sh calls it):
  python3 bench/gpu_gpt2.py --flowrun build-gpu/engine/flowrun --out build-gpu/gpu-results/bench.md
  python3 bench/gpu_gpt2.py --device cpu --tiny     # a smoke test of the script on a CPU
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
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
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # libtorch 1.13 (Debian's python3-torch): the math, for the CPU smoke test
            s = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
            s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1), float("-inf"))
            y = s.softmax(-1) @ v
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


def eager_round(cfg, device, steps, warmup, window, compile_it=False):
    """Seconds per step: median over windows of `window` steps after `warmup` steps."""
    torch.manual_seed(0)
    model = GPT(cfg["layers"], cfg["dim"], cfg["heads"], cfg["vocab"], cfg["context"]).to(device)
    opt = make_optimizer(model, device)
    fwd = torch.compile(model) if compile_it else model
    B, T = cfg["batch"], cfg["context"]
    data = torch.randint(0, cfg["vocab"], (8, B, T + 1), device=device)
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
    return statistics.median(times)


# ---- flowrun ----

def flowrun_round(flowrun, overrides, warmup, steps_field="step"):
    """Seconds per step from OUT_DIR/metrics.jsonl: median of the logged windows after warmup."""
    with tempfile.TemporaryDirectory(prefix="flowrun-gpu-bench-") as out:
        cmd = [flowrun] + overrides + ["run.out_dir=" + out, "run.progress=off"]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if p.returncode != 0:
            raise RuntimeError("flowrun failed (exit %d): %s\n%s" % (p.returncode, " ".join(cmd), p.stdout[-3000:]))
        rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
    rows = [r for r in rows if "loss" in r and r[steps_field] > warmup]
    per_step = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(rows, rows[1:])]
    if not per_step:
        raise RuntimeError("flowrun logged too few steps after warm-up")
    return statistics.median(per_step), " ".join(cmd)


def matmul_peak_tflops(device):
    if device != "cuda":
        return float("nan")
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        best = max(best, 10 * 2 * n ** 3 / (time.perf_counter() - t) / 1e12)
    return best


def flops_per_token(cfg):
    d, L, T, V = cfg["dim"], cfg["layers"], cfg["context"], cfg["vocab"]
    n = 12 * L * d * d + 13 * L * d + 2 * d + V * d  # parameters without position embeddings (nanoGPT's N)
    return 6 * n + 12 * L * d * T  # PaLM appendix B: 6N + 12 L H Q T (H*Q = d)


def gpt2(args, device):
    if args.tiny:
        cfg = dict(layers=2, dim=64, heads=2, vocab=256, context=64, batch=4, bf16=False)
        data = args.data or "data/text/fortunes_byte"
    else:
        cfg = dict(layers=12, dim=768, heads=12, vocab=50304, context=1024, batch=args.batch, bf16=device == "cuda")
        data = args.data or "data/text/fortunes_gpt2"
    overrides = ["graphs/gpt.yaml", "data.path=" + data, "data.batch=%d" % cfg["batch"],
                 "data.seq_len=%d" % cfg["context"], "model.layers=%d" % cfg["layers"], "model.dim=%d" % cfg["dim"],
                 "model.heads=%d" % cfg["heads"], "model.vocab=%d" % cfg["vocab"], "model.context=%d" % cfg["context"],
                 "run.steps=%d" % args.steps, "run.log_every=%d" % args.window, "eval.every=1000000",
                 "evlog.every=1000000", "ckpt.every=1000000", "ckpt.at=[]", "ema.every=1000000",
                 "run.device=" + device, "run.precision=" + ("bf16" if cfg["bf16"] else "fp32")]
    tokens = cfg["batch"] * cfg["context"]
    fl, eg, flow_cmd, flow_err = [], [], "", None
    for r in range(args.rounds):
        if not flow_err:
            try:
                s, flow_cmd = flowrun_round(args.flowrun, overrides, args.warmup)
                fl.append(s)
            except Exception as e:  # report the eager figures anyway, and why flowrun has none
                flow_err = str(e)
        eg.append(eager_round(cfg, device, args.steps, args.warmup, args.window))
        print("round %d: flowrun %s s/step, eager %.4f s/step" % (r + 1, "%.4f" % fl[-1] if fl and not flow_err else "-",
                                                                 eg[-1]), flush=True)
    comp = eager_round(cfg, device, args.steps, args.warmup, args.window, compile_it=True) if args.compile else None
    peak = matmul_peak_tflops(device)
    fpt = flops_per_token(cfg)
    rows = []

    def row(name, sec):
        tps = tokens / sec
        mfu = fpt * tps / (peak * 1e12) if peak == peak else float("nan")
        rows.append("| %s | %.0f | %.1f ms | %s |" % (name, tps, sec * 1e3, "%.1f %%" % (100 * mfu) if mfu == mfu else "-"))
        return tps

    e = row("PyTorch eager loop (SDPA, fused AdamW)", statistics.median(eg))
    f = row("flowrun graphs/gpt.yaml", statistics.median(fl)) if fl and not flow_err else None
    if comp:
        row("PyTorch eager + torch.compile", comp)
    lines = ["## GPT-2 124M training throughput (%s)" % ("tiny smoke config" if args.tiny else "bf16, batch %d x %d tokens" % (cfg["batch"], cfg["context"])),
             "", "| | tokens/s | per step | MFU |", "|---|---|---|---|"] + rows + [""]
    if f:
        lines.append("flowrun / eager = **%.3f x** (target >= 1.0), medians of %d alternating rounds, %d steps each "
                     "(first %d excluded)." % (f / e, args.rounds, args.steps, args.warmup))
    else:
        lines.append("flowrun: no figure: %s" % (flow_err or "not run"))
    lines.append("bf16 matmul peak measured here: %s TFLOP/s; model FLOPs per token %.3g (6N + 12LdT)." %
                 ("%.0f" % peak if peak == peak else "-", fpt))
    lines.append("flowrun command: `%s`" % flow_cmd)
    return lines


def dit(args, device):
    base = ["graphs/dit_base.yaml", "run.device=" + device, "run.steps=%d" % args.steps,
            "run.log_every=%d" % args.window, "eval.every=1000000", "evlog.every=1000000", "sample.every=1000000",
            "sample.at=[]", "ckpt.every=1000000", "ckpt.at=[]",
            # the heavy encoder: BERT-base sized (12 x 768), as HunyuanDiT's text encoder
            "text.dim=768", "text.layers=12", "text.heads=12", "text.ffn=3072", "model.text_dim=768"]
    own = base + ["text.stream=encode", "run.prefetch=4"]
    inline = base + ["text.stream=default", "data.stream=default", "run.prefetch=0"]
    a, b = [], []
    for r in range(args.rounds):
        a.append(flowrun_round(args.flowrun, own, args.warmup)[0])
        b.append(flowrun_round(args.flowrun, inline, args.warmup)[0])
        print("dit round %d: own stream %.4f s/step, inline %.4f s/step" % (r + 1, a[-1], b[-1]), flush=True)
    return ["## DiT graph: encoders on their own stream vs inline (flowrun, graphs/dit_base.yaml, BERT 12x768)", "",
            "| | steps/s |", "|---|---|",
            "| text encoder on `encode`, prefetch 4 | %.2f |" % (1 / statistics.median(a)),
            "| inline (default stream, prefetch 0) | %.2f |" % (1 / statistics.median(b)), "",
            "own stream / inline = **%.3f x** (target >= 1.2)" % (statistics.median(b) / statistics.median(a))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flowrun", default="build-gpu/engine/flowrun")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny config (a smoke test on a CPU)")
    ap.add_argument("--data", default=None, help="token shards prefix (default: scripts/data.sh's)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time the eager loop under torch.compile")
    ap.add_argument("--dit", action="store_true", help="also the DiT encoder-stream benchmark")
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    args = ap.parse_args()
    dev = args.device
    head = ["# flowrun GPU benchmarks", "",
            "device: %s; torch %s; %s" % (torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", torch.__version__,
                                          time.strftime("%Y-%m-%d")), ""]
    lines = head + gpt2(args, dev)
    if args.dit:
        lines += [""] + dit(args, dev)
    text = "\n".join(lines) + "\n"
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        open(args.out, "w").write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
