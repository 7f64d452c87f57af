#!/usr/bin/env python3
"""A DiT at a GPU size (issue 30 item 6), in one run: flowrun against the PyTorch loop of
bench/torch_dit.py, and flowrun's text encoder on its own stream against inline.

Config: graphs/dit_base.yaml by overrides (bench/torch_dit.py's dit_overrides), the same model
in the loop:
  DiT   DiT-XL/2-like: 28 blocks, hidden 1152, 16 heads (72 wide), mlp_ratio 4, patch 2 on
        4 x 32 x 32 latents (256 tokens); dit_base's HunyuanDiT layout (qk LayerNorm, 2-D RoPE,
        cross-attention to the text, long skips), text_dim 768 (BERT's width), text_len 16, no
        learned variance, no size/style conditioning, and no T5 (t5_dim 0): the loop has none
  BERT  frozen, 12 layers x 768, 12 heads, ffn 3072 (BERT-base), vocab = the lines of the
        shapes vocab (data/shapes/vocab.txt), max_length 16
  VAE   frozen encoder, seeded random, 4 blocks [32, 64, 128, 128], one resnet each, 32 groups:
        256 px -> 4 x 32 x 32; lighter than SD's (real trainers often precompute latents)
  batch 32 (--batch) of 256 px images, bf16 (autocast, fp32 master weights), AdamW lr 1e-4
  (warm-up 100), clip 1.0, EMA every step, 10 % caption dropout.
  BERT in bf16 on both sides (autocast in the loop, text.dtype=bfloat16 in flowrun); the VAE
  encoder in fp32 on both (vae.dtype stays float32, as the loop's VAE).
Data: data/shapes/xl (--data), 256 px shapes shards; both sides read them (the loop through a
DataLoader, --workers processes, pinned memory). Make them with
  flowrun prep shapes data/shapes/xl-png --set base --count 512 --size 256 --seed 1
  flowrun prep images data/shapes/xl-png data/shapes/xl --val-fraction 0.05 --seed 1
Figures (ms per step: the median over windows of --window steps after --warmup steps, one host
sync per window, start-up excluded; medians over rounds):
  (a) flowrun run.device=cuda run.precision=bf16, the graph's streams (text encoder and VAE on
      `encode`, prefetch 4), against the loop (bf16 autocast, SDPA, fused AdamW, the same EMA and
      data); the ratio: the median of the rounds' PyTorch ms / flowrun ms (> 1: flowrun faster);
  (b) that flowrun run against inline (text.stream=default vae.stream=default data.stream=default,
      prefetch 4 on both: the streams alone); the ratio: inline ms / own-stream ms.
Each round runs flowrun (own stream), the loop, flowrun (inline), one after the other; the table
is rewritten after each round, so a run cut short still leaves the rounds done.

  python3 bench/gpu_dit.py --flowrun build-gpu/engine/flowrun --out build-gpu/gpu-results/bench_dit.md
  .venv/bin/python bench/gpu_dit.py --device cpu --tiny --flowrun build/engine/flowrun
      # a smoke test on a CPU: torch_dit's DIT_DEMO sizes, data/shapes/base at 32 px, 6 steps, 1 round
A flowrun run that fails prints the last 30 lines of its output and leaves its figure out; the
script goes on and exits 3 at the end.
"""
import argparse
import contextlib
import gc
import glob
import os
import re
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_dit import (DIT_DEMO, Bert, Dit, VaeEncode, dit_overrides, dit_round,  # noqa: E402  (bench/torch_dit.py)
                       param_count)
from torch_peers import flowrun_timed, peak_memory, rounds_ratio, write_report  # noqa: E402

FAILED = []  # the runs that gave no figure: the exit status says so
OWN = ["text.stream=encode", "run.prefetch=4"]  # dit_base's own (vae and data keep theirs: encode, io)
# Inline: the same prefetch (the graph's 4), every node on the default stream: what the streams alone are worth.
INLINE = ["text.stream=default", "vae.stream=default", "data.stream=default", "run.prefetch=4"]


def xl_config(batch, vocab_txt):
    """The DiT-XL/2-like config (see the docstring), in torch_dit's DIT_DEMO layout."""
    with open(vocab_txt, encoding="utf-8") as f:
        vocab = sum(1 for _ in f)
    return dict(DIT_DEMO, batch=batch, size=256, vocab_txt=vocab_txt, lr=1e-4,
                bert=dict(vocab=vocab, dim=768, layers=12, heads=12, ffn=3072, max_positions=32, seed=7),
                vae=dict(block_out_channels=[32, 64, 128, 128], layers_per_block=1, latent_channels=4,
                         norm_num_groups=32, scaling_factor=0.36),
                dit=dict(patch=2, in_channels=4, hidden=1152, depth=28, heads=16, mlp_ratio=4.0, text_dim=768,
                         text_len=16))


def loop_params(cfg):
    """Parameters of the loop's DiT, BERT and VAE encoder (on the meta device where torch has it:
    no memory, no init)."""
    meta = torch.device("meta") if hasattr(torch.device, "__enter__") else contextlib.nullcontext()
    with meta:
        return param_count(Dit(cfg["dit"])), param_count(Bert(cfg["bert"])), param_count(VaeEncode(cfg["vae"]))


def flowrun_facts(output):
    """What flowrun logs of the model (parameters of dit, bert and vae, in millions) and its peak
    device memory."""
    grab = {"dit": r"\(dit\): ([0-9.]+)M parameters", "bert": r"frozen bert .*?\(([0-9.]+)M parameters",
            "vae": r"frozen vae .*? encoder \(([0-9.]+)M parameters"}
    facts = {k: m.group(1) for k, m in ((k, re.search(r, output)) for k, r in grab.items()) if m}
    if peak_memory(output):
        facts["peak"] = peak_memory(output)
    return facts


def try_flowrun(what, args, overrides, facts):
    """Seconds per step of one flowrun run, or None (its output's tail printed, FAILED noted)."""
    try:
        sec, output, _ = flowrun_timed(args.flowrun, overrides, args.warmup, args.run_timeout)
    except Exception as e:  # go on: the other figures still come
        print("flowrun failed (%s): %s" % (what, e), file=sys.stderr, flush=True)
        FAILED.append(what)
        return None
    facts.update(flowrun_facts(output))
    return sec


def try_loop(args, cfg, device, precision, peaks):
    """Seconds per step of the PyTorch loop, or None; its peak GPU memory appended to peaks."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        sec = dit_round(cfg, args.data, args.steps, args.warmup, args.window, workers=args.workers, device=device,
                        precision=precision)
    except Exception as e:  # (no PIL, out of memory...): the flowrun figures still come
        print("PyTorch loop failed: %s: %s" % (type(e).__name__, e), file=sys.stderr, flush=True)
        FAILED.append("PyTorch loop")
        sec = None
    if device.startswith("cuda"):
        peaks.append(torch.cuda.max_memory_allocated())
    gc.collect()  # the round's model, optimizer and DataLoader workers go before the next flowrun run
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return sec


def ms(secs):
    return "%.1f" % (1e3 * statistics.median(secs)) if secs else "-"


def per_sec(secs, batch):
    return "%.1f" % (batch / statistics.median(secs)) if secs else "-"


def describe(args, cfg):
    """The config in one paragraph."""
    d, b, v = cfg["dit"], cfg["bert"], cfg["vae"]
    lat = cfg["size"] // 2 ** (len(v["block_out_channels"]) - 1)
    return ("Config (%s): DiT %d blocks x %d, %d heads, mlp_ratio %g, patch %d on %d x %d x %d latents (%d tokens), "
            "text_dim %d, text_len %d, no T5 (t5_dim 0: the PyTorch loop has none), no learned variance; frozen BERT "
            "%d x %d (%d heads, ffn %d, vocab %d); frozen VAE encoder %s, %d resnet per block, %d groups (%d px -> "
            "%d x %d; lighter than SD's: real trainers often precompute latents); batch %d, AdamW lr %g, clip %g, EMA "
            "every step. Data: %s." % (
                "tiny smoke config" if args.tiny else "DiT-XL/2-like", d["depth"], d["hidden"], d["heads"],
                d["mlp_ratio"], d["patch"], d["in_channels"], lat, lat, (lat // d["patch"]) ** 2, d["text_dim"],
                d["text_len"], b["layers"], b["dim"], b["heads"], b["ffn"], b["vocab"], v["block_out_channels"],
                v["layers_per_block"], v["norm_num_groups"], cfg["size"], lat, lat, cfg["batch"], cfg["lr"], cfg["clip"],
                args.data))


def precision_note(precision):
    if precision != "bf16":
        return "Precision: fp32 on both sides."
    return ("Precision: bf16 with fp32 master weights. The loop: the forwards of the DiT and BERT under bf16 "
            "autocast. flowrun: run.precision=bf16 (the DiT's forward under autocast), text.dtype=bfloat16 "
            "(BERT's weights and math in bf16). The VAE encoder in fp32 on both sides (vae.dtype=float32, as "
            "the loop's).")


def loop_features(device, precision):
    return ", ".join(["bf16 autocast" if precision == "bf16" else "fp32",
                      "SDPA" if hasattr(torch.nn.functional, "scaled_dot_product_attention") else "math attention",
                      "fused AdamW" if device.startswith("cuda") else "AdamW"])


def table(args, cfg, device, precision, res, facts, peaks, cmd, n):
    """The markdown report of the rounds so far; n: the loop's parameters (loop_params)."""
    fl, pt, il = ([x for x in res[k] if x is not None] for k in ("own", "loop", "inline"))
    B = cfg["batch"]
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    return [
        "# DiT at a GPU size: flowrun vs PyTorch, own stream vs inline", "",
        "device: %s; torch %s; %s; %s" % (name, torch.__version__, precision, time.strftime("%Y-%m-%d")), "",
        describe(args, cfg), "",
        precision_note(precision), "",
        "Parameters: DiT %.2fM, BERT %.2fM, VAE encoder %.2fM (the PyTorch loop's); flowrun logs %sM, %sM, %sM." % (
            n[0] / 1e6, n[1] / 1e6, n[2] / 1e6, facts.get("dit", "?"), facts.get("bert", "?"), facts.get("vae", "?")), "",
        "## (a) flowrun vs the PyTorch loop", "",
        "| | ms/step | images/s | peak GPU memory |", "|---|---|---|---|",
        "| flowrun graphs/dit_base.yaml (text encoder and VAE on `encode`, prefetch 4) | %s | %s | %s |" % (
            ms(fl), per_sec(fl, B), facts.get("peak", "-")),
        "| PyTorch eager loop (bench/torch_dit.py: %s, DataLoader %d workers) | %s | %s | %s |" % (
            loop_features(device, precision), args.workers, ms(pt), per_sec(pt, B),
            "%.1f GB" % (max(peaks) / 1e9) if peaks else "-"), "",
        "flowrun / PyTorch speed (PyTorch ms over flowrun ms; > 1: flowrun faster) = %s. Peak GPU memory: the caching "
        "allocator's allocated peak (flowrun's end-of-run log; torch.cuda.max_memory_allocated), GB = 10^9 bytes." %
        rounds_ratio(res["loop"], res["own"]), "",
        "## (b) flowrun: text encoder on its own stream vs inline", "",
        "| | ms/step | images/s |", "|---|---|---|",
        "| text encoder and VAE on `encode`, prefetch 4 (the graph's) | %s | %s |" % (ms(fl), per_sec(fl, B)),
        "| inline (`%s`) | %s | %s |" % (" ".join(INLINE), ms(il), per_sec(il, B)), "",
        "own stream / inline (inline ms over own-stream ms) = %s." % rounds_ratio(res["inline"], res["own"]), "",
        "Rounds: %d done of %d, each flowrun (own stream), the PyTorch loop, flowrun (inline); %d steps per run, "
        "per-step time the median of %d-step windows after the first %d steps (start-up excluded); medians over "
        "rounds." % (len(res["own"]), args.rounds, args.steps, args.window, args.warmup), "",
        "flowrun command (own stream): `%s`" % cmd, "",
        "PyTorch loop: bench/torch_dit.py, in this process (`%s`)." % " ".join([os.path.basename(sys.executable)] + sys.argv),
    ]


def data_missing(data):
    if glob.glob(data + ".train-*.tar"):
        return None
    return ("%s.train-*.tar missing: make it with `flowrun prep shapes %s-png --set base --count 512 --size 256 --seed 1` "
            "then `flowrun prep images %s-png %s --val-fraction 0.05 --seed 1`, or pass --data" % (data, data, data, data))


def vocab_path(args):
    """data/shapes/vocab.txt, or the vocab `flowrun prep shapes` wrote beside the images (DATA-png/)."""
    if args.vocab:
        return args.vocab
    for p in ("data/shapes/vocab.txt", args.data + "-png/vocab.txt"):
        if os.path.exists(p):
            return p
    return "data/shapes/vocab.txt"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flowrun", default="build-gpu/engine/flowrun")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="torch_dit's DIT_DEMO sizes at 32 px, 6 steps, 1 round (a CPU smoke test)")
    ap.add_argument("--data", default=None, help="shards prefix (default data/shapes/xl; --tiny: data/shapes/base)")
    ap.add_argument("--vocab", default=None, help="WordPiece vocab (default data/shapes/vocab.txt, else DATA-png/vocab.txt)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 40; --tiny 6)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 10; --tiny 2)")
    ap.add_argument("--window", type=int, default=None, help="steps per timed window (default 10; --tiny 2)")
    ap.add_argument("--rounds", type=int, default=None, help="default 2 (--tiny 1)")
    ap.add_argument("--workers", type=int, default=None, help="DataLoader workers of the loop (default 8; --tiny 1)")
    ap.add_argument("--run-timeout", type=int, default=100, help="seconds one flowrun run may take")
    ap.add_argument("--out", default=None, help="write the markdown table here too (after each round)")
    args = ap.parse_args()
    tiny = dict(data="data/shapes/base", steps=6, warmup=2, window=2, rounds=1, workers=1)
    full = dict(data="data/shapes/xl", steps=40, warmup=10, window=10, rounds=2, workers=8)
    for k, v in (tiny if args.tiny else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main():
    args = parse_args()
    dev = args.device
    precision = "bf16" if dev.startswith("cuda") else "fp32"
    missing = data_missing(args.data)
    if missing:
        print("gpu_dit.py: no run: " + missing, file=sys.stderr)
        write_report(args.out, ["# DiT at a GPU size", "", "no figure: " + missing])
        return 3
    vocab = vocab_path(args)
    cfg = dict(DIT_DEMO, batch=args.batch) if args.tiny else xl_config(args.batch, vocab)
    base = dit_overrides(cfg, args.data, args.steps, args.window, 0, "cuda" if dev.startswith("cuda") else dev, precision)
    base += ["eval.batch=8", "eval.batches=1"]  # never run, but checked at setup: data/shapes/xl's val split holds 26 images
    if precision == "bf16":
        base.append("text.dtype=bfloat16")  # the BERT in bf16, as the loop's autocast (the VAE: see the docstring)
    res, facts, peaks, n = {"own": [], "loop": [], "inline": []}, {}, [], loop_params(cfg)
    cmd = " ".join(shlex.quote(a) for a in [args.flowrun] + base + OWN)
    for r in range(args.rounds):
        res["own"].append(try_flowrun("own stream, round %d" % (r + 1), args, base + OWN, facts))
        res["loop"].append(try_loop(args, cfg, dev, precision, peaks))
        res["inline"].append(try_flowrun("inline, round %d" % (r + 1), args, base + INLINE, facts))
        print("round %d: flowrun own stream %s, PyTorch %s, flowrun inline %s ms/step" % (
            r + 1, *("-" if x is None else "%.1f" % (1e3 * x) for x in (res["own"][-1], res["loop"][-1], res["inline"][-1]))),
            flush=True)
        text = write_report(args.out, table(args, cfg, dev, precision, res, facts, peaks, cmd, n))
    print(text)
    if FAILED:
        print("gpu_dit.py: no figure for: %s (see above)" % ", ".join(FAILED), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
