#!/usr/bin/env python3
"""GPU benchmarks of flowrun against what users would run instead, in one run.

GPT-2 124M (12 layers, 768 wide, 12 heads, 1024 tokens, vocab 50304, bf16 autocast with fp32
master weights, AdamW, clip 1.0):
  - flowrun: `flowrun graphs/gpt.yaml` with run.device=cuda run.precision=bf16 (EMA, eval and
    checkpoints moved out of the way by overrides), tokens/s from its metrics.jsonl;
  - eager: a plain PyTorch training loop of the same model (HF GPT-2 layout, SDPA, fused AdamW);
  - compile: the same loop with the model under torch.compile (--compile), the stronger peer.
Data: flowrun reads GPT-2 BPE token shards (--data, default data/text/fortunes_gpt2, made by
scripts/data.sh); the PyTorch loop trains on seeded random tokens (the speed of a step does not
depend on them).
Rounds (`--rounds`, default 5) alternate flowrun / eager / compile; each run's per-step time is
the median over windows of `--window` steps after `--warmup` steps (start-up and compilation
excluded; one host sync per window on both sides: flowrun's metrics node logs every `--window`
steps, the loop reads its loss); the table gives each side's median and range over the rounds,
the per-round ratios flowrun / eager and flowrun / compile (median and range) and model FLOPs
utilization (MFU): (6N + 12 L d T) x tokens/s, N = all parameters but the position embeddings,
against the card's datasheet dense bf16 peak (DATASHEET_BF16) and against the bf16 matmul peak
measured here (best of a few 8192^3 products).

Activation checkpointing (`--memory`, issue 32): a GPT-2 350M-size graph with `checkpoint: blocks`
against none, the peak device memory flowrun logs at the end and s/step, at a batch both fit and at
one only the checkpointed run should fit (`--memory-batches`).

DiT (`--dit`): graphs/dit_base.yaml with a heavy text encoder (BERT 12 x 768) on the GPU,
steps/s with the encoder on its own stream (`text.stream=encode`, prefetch 4) against inline
(`text.stream=default`, the same prefetch 4), alternating rounds.

Usage (tests/gpu/run.sh calls it):
  python3 bench/gpu_gpt2.py --flowrun build-gpu/engine/flowrun --compile --dit --out build-gpu/gpu-results/bench.md
  .venv/bin/python bench/gpu_gpt2.py --device cpu --tiny --flowrun build/engine/flowrun
      # a smoke test of the script on a CPU (Debian's python3-torch; byte shards, 2 x 64 model)
A flowrun run that fails (or missing shards) leaves its figure out, says why, and makes the
exit status 3; the PyTorch figures and the table are still printed.
"""
import argparse
import glob
import os
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_peers import (eager_round, flowrun_round, gpt_overrides, ms_range, peak_memory, rounds_ratio,  # noqa: E402
                         run_flowrun, seconds_per_step, write_report)


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
    """PaLM appendix B: 6N + 12 L H Q T (H*Q = d), N = every parameter but the position
    embeddings (the tied token embedding / LM head counted once, as nanoGPT's MFU)."""
    d, L, T, V = cfg["dim"], cfg["layers"], cfg["context"], cfg["vocab"]
    n = 12 * L * d * d + 13 * L * d + 2 * d + V * d
    return 6 * n + 12 * L * d * T, n


def fail(what, err):
    """Prints why a flowrun run gave no figure (the tail of its output) and returns one line."""
    text = str(err).strip()
    print("flowrun failed (%s):\n%s" % (what, text[-2000:]), file=sys.stderr, flush=True)
    FAILED.append(what)
    lines = [l for l in text.splitlines() if l.strip()] or [type(err).__name__]
    if len(lines) == 1:
        return lines[0][:300]
    return "%s: %s" % (lines[0].split(":")[0], lines[-1][:300])  # "flowrun failed (exit N): <its last line>"


FAILED = []  # the flowrun runs that gave no figure: the exit status says so


def shards_missing(data):
    if os.path.exists(data + ".train.bin") and os.path.exists(data + ".train.idx"):
        return None
    return ("token shards %s.train.{bin,idx} missing: make them with scripts/data.sh (on a machine with the "
            "Debian package fortunes and PyPI) and carry data/text/ here, or pass --data" % data)


# Dense bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s, no sparsity), by the name
# torch.cuda.get_device_name gives; MFU is quoted against this beside the measured matmul peak.
DATASHEET_BF16 = [("H200", 989.4), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.4),
                  ("A100", 312.0), ("L40S", 362.1), ("L4", 121.0)]


def datasheet_peak(name):
    """(the card's datasheet dense bf16 TFLOP/s, the name it was matched by), or (nan, None)."""
    for key, tflops in DATASHEET_BF16:
        if key in name:
            return tflops, key
    return float("nan"), None


def gpt2(args, device):
    if args.tiny:
        cfg = dict(layers=2, dim=64, heads=2, vocab=256, context=64, batch=4, bf16=False)
        data = args.data or "data/text/fortunes_byte"
    else:
        cfg = dict(layers=12, dim=768, heads=12, vocab=50304, context=1024, batch=args.batch, bf16=device == "cuda")
        data = args.data or "data/text/fortunes_gpt2"
    overrides = gpt_overrides(cfg, data, args.steps, args.window, device)
    tokens = cfg["batch"] * cfg["context"]
    flow_cmd = " ".join([args.flowrun] + overrides)
    # Per round, one figure per side (None where that side failed this round), in the order run:
    # flowrun, flowrun with run.cuda_graph (--cuda-graph), the eager loop, the loop under
    # torch.compile (--compile).
    res = {"flowrun": [], "flowrun_graph": [], "eager": [], "compile": []}
    graph_overrides = overrides + ["run.cuda_graph=true"]
    graph_err = None if args.cuda_graph else "not run (--cuda-graph)"
    flow_err = shards_missing(data)
    comp_err = None if args.compile else "not run (--compile)"
    if flow_err:
        print("flowrun: no run: " + flow_err, file=sys.stderr, flush=True)
        FAILED.append("GPT-2 data")
    for r in range(args.rounds):
        s = None
        if not flow_err:
            try:
                s, flow_cmd = flowrun_round(args.flowrun, overrides, args.warmup)
            except Exception as e:  # report the PyTorch figures anyway, and why flowrun has none
                flow_err = fail("GPT-2, round %d" % (r + 1), e)
        res["flowrun"].append(s)
        g = None
        if not flow_err and not graph_err:
            try:
                g = flowrun_round(args.flowrun, graph_overrides, args.warmup)[0]
            except Exception as e:
                graph_err = fail("GPT-2 run.cuda_graph, round %d" % (r + 1), e)
        res["flowrun_graph"].append(g)
        res["eager"].append(eager_round(cfg, device, args.steps, args.warmup, args.window))
        c = None
        if not comp_err:
            try:  # a fresh model each round, as eager; the first round's warm-up steps hold the compile
                c = eager_round(cfg, device, args.steps, args.warmup, args.window, compile_it=True)
            except Exception as e:  # no Triton, or the compiler failed: say so, keep the rest
                comp_err = ("%s: %s" % (type(e).__name__, e)).splitlines()[0][:200]
                print("torch.compile failed: " + comp_err, file=sys.stderr, flush=True)
        res["compile"].append(c)
        print("round %d: %s" % (r + 1, ", ".join("%s %s ms/step" % (k, "-" if v[-1] is None else "%.2f" % (1e3 * v[-1]))
                                                 for k, v in res.items())), flush=True)
    measured = matmul_peak_tflops(device)
    card = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    sheet, sheet_name = datasheet_peak(card)
    fpt, n_params = flops_per_token(cfg)

    def mfu(secs, peak):
        done = [s for s in secs if s is not None]
        if not done or peak != peak:
            return "-"
        return "%.1f %%" % (100 * fpt * tokens / statistics.median(done) / (peak * 1e12))

    feats = ["SDPA" if hasattr(F, "scaled_dot_product_attention") else "math attention",
             "fused AdamW" if device == "cuda" else "AdamW"] + (["bf16 autocast"] if cfg["bf16"] else [])
    names = {"flowrun": "flowrun graphs/gpt.yaml", "flowrun_graph": "the same, `run.cuda_graph=true`", "eager": "PyTorch eager loop (%s)" % ", ".join(feats),
             "compile": "the same loop, model under torch.compile"}
    rows = []
    for k, secs in res.items():
        done = [s for s in secs if s is not None]
        if k == "flowrun_graph" and not args.cuda_graph:
            continue
        if not done:
            why = {"flowrun": flow_err, "flowrun_graph": graph_err, "compile": comp_err}.get(k) or "no figure"
            rows.append("| %s | no figure: %s | | | |" % (names[k], (why or "-").replace("|", "/")[:300]))
            continue
        rows.append("| %s | %.0f | %s | %s | %s |" % (names[k], tokens / statistics.median(done), ms_range(done),
                                                      mfu(done, sheet), mfu(done, measured)))
    title = "tiny smoke config" if args.tiny else "bf16, batch %d x %d tokens" % (cfg["batch"], cfg["context"])
    lines = ["## GPT-2 124M training throughput (%s), %s" % (title, card), "",
             "| | tokens/s | per step, median (range over rounds) | MFU (datasheet peak) | MFU (measured peak) |",
             "|---|---|---|---|---|"] + rows + [""]
    lines.append("flowrun / eager (eager ms over flowrun ms, per round) = %s; flowrun / torch.compile = %s. "
                 "%d alternating rounds, each flowrun, %seager, torch.compile; %d steps a run, the first %d excluded, "
                 "medians of %d-step windows." % (rounds_ratio(res["eager"], res["flowrun"]),
                                                  rounds_ratio(res["compile"], res["flowrun"]), args.rounds,
                                                  "flowrun with run.cuda_graph, " if args.cuda_graph else "",
                                                  args.steps, args.warmup, args.window))
    if args.cuda_graph:
        lines.append("")
        lines.append("With run.cuda_graph (forward and backward replayed as one CUDA graph): flowrun / eager = %s; "
                     "flowrun / torch.compile = %s; against flowrun without it = %s." %
                     (rounds_ratio(res["eager"], res["flowrun_graph"]), rounds_ratio(res["compile"], res["flowrun_graph"]),
                      rounds_ratio(res["flowrun"], res["flowrun_graph"])))
    lines.append("")
    lines.append("MFU: model FLOPs per token %.4g = 6N + 12 L d T (PaLM appendix B; N = %.1fM, every parameter but "
                 "the position embeddings, the tied embedding counted once) x tokens/s, over %s, and over the best "
                 "bf16 matmul measured here, %s TFLOP/s (3 x 10 products of 8192 x 8192, random data)." %
                 (fpt, n_params / 1e6,
                  "the %s datasheet's dense bf16 peak, %.0f TFLOP/s" % (sheet_name, sheet) if sheet_name
                  else "no datasheet peak (card not in bench/gpu_gpt2.py's DATASHEET_BF16)",
                  "%.0f" % measured if measured == measured else "-"))
    lines.append("")
    lines.append("flowrun command: `%s`" % flow_cmd)
    lines.append("")
    lines.append("PyTorch loop: bench/torch_peers.py, in this process (`%s`)." % " ".join([os.path.basename(sys.executable)] + sys.argv))
    return lines


def dit(args, device):
    base = ["graphs/dit_base.yaml", "run.device=" + device, "run.steps=%d" % args.steps,
            "run.log_every=%d" % args.window, "eval.every=1000000", "evlog.every=1000000", "sample.every=1000000",
            "sample.at=[]", "fid.every=1000000", "fid.at=[]", "evlog.at=[]", "ckpt.every=1000000", "ckpt.at=[]",
            "vae.weights=null",  # the VAE seeded random (the sampler decodes with it): no trained one needed
            # the heavy encoder: BERT-base sized (12 x 768), as HunyuanDiT's text encoder
            "text.dim=768", "text.layers=12", "text.heads=12", "text.ffn=3072", "model.text_dim=768"]
    own = base + ["text.stream=encode", "run.prefetch=4"]
    inline = base + ["text.stream=default", "vae.stream=default", "data.stream=default", "run.prefetch=4"]
    title = "## DiT graph: encoders on their own stream vs inline (flowrun, graphs/dit_base.yaml, BERT 12x768)"
    if not glob.glob("data/shapes/base.train-*.tar"):
        FAILED.append("DiT data")
        return [title, "", "no figure: data/shapes/base.train-*.tar missing (tests/gpu/run.sh or scripts/data.sh renders it)"]
    a, b = [], []
    try:
        for r in range(args.rounds):
            a.append(flowrun_round(args.flowrun, own, args.warmup)[0])
            b.append(flowrun_round(args.flowrun, inline, args.warmup)[0])
            print("dit round %d: own stream %.4f s/step, inline %.4f s/step" % (r + 1, a[-1], b[-1]), flush=True)
    except Exception as e:  # keep the GPT-2 table
        return [title, "", "no figure: " + fail("DiT", e)]
    return [title, "",
            "| | steps/s |", "|---|---|",
            "| text encoder on `encode`, prefetch 4 | %.2f |" % (1 / statistics.median(a)),
            "| inline (default stream, prefetch 4) | %.2f |" % (1 / statistics.median(b)), "",
            "own stream / inline = **%.3f x** (target >= 1.2)" % (statistics.median(b) / statistics.median(a))]


def flowrun_memory_run(flowrun, overrides):
    """One short flowrun run: (seconds per step between its logged steps, the peak memory flowrun
    logs at the end, forward_backward's estimate, why it failed or None)."""
    _, code, output, rows = run_flowrun(flowrun, overrides)
    estimate = memory_estimate(output)
    peak = peak_memory(output, resident=True)  # the device's where flowrun has one (CUDA)
    if code != 0 or not peak:
        lines = [l for l in output.splitlines() if l.strip()]
        why = next((l for l in reversed(lines) if "error" in l.lower() or "memory" in l.lower()), lines[-1] if lines else "")
        return None, None, estimate, why.strip()[:400]
    sec = seconds_per_step(rows)
    return (float("nan") if sec is None else sec), peak, estimate, None


def memory_estimate(text):
    """forward_backward's estimate of the step's memory, from its log line ("... = 24.1 GB; ...")."""
    m = re.search(r"memory per rank \(estimate\): .*? = ([0-9.]+ [KMGT]?B)", text)
    return m.group(1) if m else "-"


def memory(args, device):
    """Issue 32's GPU check: a GPT-2 350M-size model (24 x 1024, 16 heads, 1024 tokens) with
    `checkpoint: blocks` against `none`, peak device memory (the caching allocator's peak, as
    torch.cuda.max_memory_allocated) and s/step at a batch both fit, then at a batch that only the
    checkpointed run should fit."""
    if args.tiny:
        cfg = dict(layers=2, dim=64, heads=2, vocab=256, context=64, bf16=False)
        data, small, big = args.data or "data/text/fortunes_byte", 4, 8
    else:
        cfg = dict(layers=24, dim=1024, heads=16, vocab=50304, context=1024, bf16=device == "cuda")
        data, small, big = args.data or "data/text/fortunes_gpt2", args.memory_batches[0], args.memory_batches[1]
    title = "## Activation checkpointing: GPT-2 350M-size (%d x %d, %d tokens), peak device memory" % (
        cfg["layers"], cfg["dim"], cfg["context"])
    err = shards_missing(data)
    if err:
        FAILED.append("memory data")
        return [title, "", "no figure: " + err]
    rows = ["| batch | checkpoint | s/step | peak memory | flowrun's estimate | |", "|---|---|---|---|---|---|"]
    for batch in (small, big):
        for policy in ("none", "blocks"):
            c = dict(cfg, batch=batch)
            ov = gpt_overrides(c, data, 6, 2, device) + ["model.checkpoint=" + policy]
            sec, peak, estimate, why = flowrun_memory_run(args.flowrun, ov)
            print("memory: batch %d checkpoint %s: %s" % (batch, policy, why or "%.4f s/step, peak %s" % (sec, peak)), flush=True)
            rows.append("| %d | %s | %s | %s | %s | %s |" % (batch, policy, "-" if sec is None else "%.3f" % sec,
                                                             peak or "-", estimate,
                                                             (why or "").replace("|", "/")))
    return [title, "", "flowrun graphs/gpt.yaml, %s, 6 steps each (s/step: median of 2-step windows after the "
            "first)." % ("bf16" if cfg["bf16"] else "fp32"), ""] + rows


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
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also time the loop under torch.compile, in each round")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also time flowrun with run.cuda_graph=true (forward and backward as a CUDA graph), in each round")
    ap.add_argument("--dit", action="store_true", help="also the DiT encoder-stream benchmark")
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    ap.add_argument("--memory", action="store_true",
                    help="also activation checkpointing's peak memory (GPT-2 350M size, issue 32)")
    ap.add_argument("--memory-batches", type=int, nargs=2, default=[16, 128], metavar=("FITS", "BIG"),
                    help="--memory's batches: one both runs fit, one only checkpointing should")
    ap.add_argument("--only", choices=["gpt2", "dit", "memory"], default=None, help="run this part alone")
    args = ap.parse_args()
    dev = args.device
    head = ["# flowrun GPU benchmarks", "",
            "device: %s; torch %s; %s" % (torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", torch.__version__,
                                          time.strftime("%Y-%m-%d")), ""]
    lines = list(head)
    if args.only in (None, "gpt2"):
        lines += gpt2(args, dev)
    if args.dit or args.only == "dit":
        lines += [""] + dit(args, dev)
    if args.memory or args.only == "memory":
        lines += [""] + memory(args, dev)
    print(write_report(args.out, lines))
    if FAILED:
        print("gpu_gpt2.py: no flowrun figure for: %s (see above)" % ", ".join(FAILED), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
