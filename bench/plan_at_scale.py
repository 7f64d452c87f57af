#!/usr/bin/env python3
"""`flowrun plan` at scale, by simulation (issue 50; docs/parallel.md "At scale").

No H100 is at hand, so the profile `flowrun plan` would measure on one is written here from each
model's shape (the same fields `flowrun plan --save-profile` writes), and the plan searches the
layouts of 8, 64 and 512 H100-80GB (8 a node, NVLink 900 GB/s inside a node, 50 GB/s a GPU between
nodes) from it:

  a block's time      its matrix products' FLOPs at 60 % of the datasheet's 989 TFLOP/s (bf16), its
                      attention's at 40 % (FlashAttention-2's forward reaches about that on an H100),
                      backward twice forward (frozen weights: once, no weight gradients), plus 60 us
                      forward and 120 us backward of kernel launches
  activations         Korthikanti et al.'s 34 bytes a token and hidden unit a block in bf16, fused
                      attention's fp32 logsumexp; GPT's fp32 logits and their gradient at the head
  memory a parameter  flowrun's: fp32 weights and gradients, AdamW's two fp32 moments, an fp32 EMA
  the update          fused AdamW and the EMA read and write 36 bytes a parameter at 2.7 TB/s
  other nodes         HunyuanDiT's frozen VAE encoder and text encoders (mT5-XL, CLIP) on each image:
                      about 3.1 TFLOP forward at 40 %

  python3 bench/plan_at_scale.py --flowrun build/engine/flowrun [--gemm 0.6] [--work DIR]

--gemm sets the matrix products' share of the peak (attention: two thirds of it): 0.6 is what the
kernels reach on these sizes; flowrun's own GPT-2 124M step reaches 32-36 % MFU on an H200
(bench/README.md), so --gemm 0.35 is closer to what flowrun itself would do today.

Prints a markdown table of each model's fastest layout that fits, per cluster size.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

PEAK = 989e12
EFFICIENCY = [0.60]  # the matrix products' share of the peak (--gemm)
ATTN = 0.40  # the encoders' (other nodes') share
LAUNCH_F, LAUNCH_B = 60e-6, 120e-6
UPDATE_S_PER_PARAM = 36 / 2.7e12


def block(params, split, fwd_gemm_flops, attn_flops, act_bytes, out_bytes, frozen=0.0):
    GEMM, ATTN = EFFICIENCY[0], EFFICIENCY[0] * 2 / 3
    f = fwd_gemm_flops / (PEAK * GEMM) + attn_flops / (PEAK * ATTN)
    b = (1.0 if frozen else 2.0) * fwd_gemm_flops / (PEAK * GEMM) + 2.0 * attn_flops / (PEAK * ATTN)
    return {"fwd_s": f + LAUNCH_F, "bwd_s": b + LAUNCH_B, "fwd0_s": LAUNCH_F, "bwd0_s": LAUNCH_B, "params": params,
            "frozen": frozen, "split": split, "activation_bytes": act_bytes, "output_bytes": out_bytes}


def gpt(layers, dim, heads, vocab, context):
    """flowrun's GPT (models/gpt/gpt.hpp): LayerNorm, a 4 x dim GELU MLP, learned positions, tied head."""
    T = context
    bp = 12 * dim * dim + 13 * dim
    blocks = [block(bp, 12 * dim * dim / bp, 2 * 12 * dim * dim * T, 4 * T * T * dim,
                    34 * T * dim + 4 * heads * T, 2 * T * dim) for _ in range(layers)]
    head_f = 2 * T * dim * vocab
    first = block(vocab * dim + context * dim, 0, 0, 0, 0, 0)
    first.update(fwd_s=LAUNCH_F, bwd_s=LAUNCH_B)
    last = block(2 * dim, 0, head_f, 0, 2 * T * vocab * 4, 0)
    flops = 6 * (layers * bp + vocab * dim) * T + 12 * layers * T * T * dim
    return {"rows": 1, "blocks": blocks, "first": first, "last": last, "tied": True, "weight_bytes": 4,
            "grad_bytes": 4, "optimizer_bytes": 8, "ema_bytes": 4, "update_s_per_param": UPDATE_S_PER_PARAM,
            "other_s": 0.0, "flops_per_row": flops, "tokens_per_row": T, "splits": True,
            "frozen": False}


def hunyuan_dit(lora_rank=0):
    """HunyuanDiT-v1.2 at 1024 px: 40 blocks of 1408 (16 heads, MLP 6144), 4096 patch tokens (128 x 128
    latents, patch 2), cross-attention to 256 mT5 + 77 CLIP tokens projected to 1024, long skips into the
    last 19 blocks; 1.5B parameters. LoRA: rank r on to_q, to_k, to_v, to_out.0 of both attentions."""
    d, T, text, td, mlp = 1408, 4096, 333, 1024, 6144
    blocks = []
    for i in range(40):
        gemm = 7 * d * d + 2 * td * d + 2 * d * mlp + (2 * d * d if i >= 21 else 0)  # + the long skip's linear
        bp = gemm + 12 * d
        f = 2 * T * (gemm - 2 * td * d) + 2 * text * 2 * td * d
        attn = 4 * T * T * d + 4 * T * text * d
        lora = lora_rank * (4 * 2 * d + 2 * 2 * d + 2 * (td + d)) if lora_rank else 0
        blocks.append(block(bp + lora, (4 * d * d + 2 * d * mlp + 2 * d * d + 2 * td * d) / bp, f, attn,
                            34 * T * d + 4 * 16 * T, 2 * T * d, frozen=bp if lora_rank else 0.0))
    first = block(60e6, 0, 0, 0, 0, 0, frozen=60e6 if lora_rank else 0.0)  # patch, time and text embedders
    first.update(fwd_s=LAUNCH_F, bwd_s=LAUNCH_B)
    last = block(2 * d * d + d * 32, 0, 2 * T * d * 32, 0, T * 32 * 4, 0, frozen=(2 * d * d + d * 32) if lora_rank else 0.0)
    n = sum(b["params"] - (b["frozen"] if lora_rank else 0) for b in blocks)
    flops = (4 if lora_rank else 6) * sum(b["params"] for b in blocks) * T + 12 * 40 * T * (T + text) * d
    encoders = 3.1e12 / (PEAK * ATTN)  # a 1024 px image's VAE encoding and its two captions' encoding
    return {"rows": 1, "blocks": blocks, "first": first, "last": last, "tied": False, "weight_bytes": 4,
            "grad_bytes": 4, "optimizer_bytes": 8, "ema_bytes": 4 if not lora_rank else 0,
            "update_s_per_param": UPDATE_S_PER_PARAM, "other_s": encoders, "flops_per_row": flops,
            "tokens_per_row": T, "splits": True, "frozen": bool(lora_rank), "_trained": n}


def models():
  return [
    # name, graph and overrides (the plan reads its nodes' names and sizes), profile, rows a device
    ("GPT-2 1.5B (48 x 1600, 25 heads, 1024 tokens)",
     ["graphs/gpt.yaml", "model.layers=48", "model.dim=1600", "model.heads=25", "model.context=1024", "data.seq_len=1024"],
     gpt(48, 1600, 25, 50257, 1024), 8),
    ("Llama-3-8B-shaped GPT (32 x 4096, 32 heads, 128K vocabulary, 8192 tokens)",
     ["graphs/gpt.yaml", "model.layers=32", "model.dim=4096", "model.heads=32", "model.vocab=128256",
      "model.context=8192", "data.seq_len=8192"],
     gpt(32, 4096, 32, 128256, 8192), 2),
    ("HunyuanDiT-v1.2, 1024 px, full fine-tune", ["graphs/hydit_v12_lora.yaml", "model.lora=null"], hunyuan_dit(0), 4),
    ("HunyuanDiT-v1.2, 1024 px, LoRA rank 64 (graphs/hydit_v12_lora.yaml)", ["graphs/hydit_v12_lora.yaml"],
     hunyuan_dit(64), 4),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flowrun", default="build/engine/flowrun")
    ap.add_argument("--devices", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--work", default=None)
    ap.add_argument("--gemm", type=float, default=0.60)
    a = ap.parse_args()
    EFFICIENCY[0] = a.gemm
    work = a.work or tempfile.mkdtemp(prefix="plan-at-scale-")
    os.makedirs(work, exist_ok=True)
    print("| model | H100s | rows (global) | fastest layout that fits | step s | tokens/s/GPU | MFU | memory/GPU | bubble | comm |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for k, (name, graph, profile, rows_per_device) in enumerate(models()):
        prof = f"{work}/profile{k}.json"
        json.dump({x: v for x, v in profile.items() if not x.startswith("_")}, open(prof, "w"))
        for n in a.devices:
            table = f"{work}/table{k}_{n}.json"
            rows = rows_per_device * n
            cmd = [a.flowrun, "plan", *graph, "--profile", prof, "--devices", str(n), "--gpus-per-node", "8",
                   "--device-memory", "80GB", "--bandwidth", "intra=900,inter=50", "--latency", "intra=5,inter=20",
                   "--global-batch", str(rows), "--peak-tflops", "989", "--table", table, "--top", "3"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode not in (0, 1):
                sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
            layouts = json.load(open(table))["layouts"]
            best = next((x for x in layouts if x["fits"]), None)
            if best is None:
                print(f"| {name} | {n} | {rows} | none fits 80 GB | | | | | | |")
                continue
            tokens = profile["tokens_per_row"] * rows / best["step_s"] / n
            print(f"| {name} | {n} | {rows} | {best['layout']} | {best['step_s']:.3f} | {tokens:,.0f} | "
                  f"{100*best['mfu']:.1f} % | {best['memory']['total']/2**30:.1f} GiB | {100*best['bubble']:.1f} % | "
                  f"{100*best['comm_s']/best['step_s']:.1f} % |", flush=True)


if __name__ == "__main__":
    main()
