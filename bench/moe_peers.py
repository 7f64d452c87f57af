#!/usr/bin/env python3
"""flowrun's mixture-of-experts block (models/moe.hpp, run by build/bench/moe_bench) against
transformers' Qwen3MoeSparseMoeBlock (its eager experts: a loop over the experts a batch reaches,
each gathering its tokens by a mask's indices), forward and backward, on this machine's CPU, in
one run (issue 73's block bar: 1.5x).

Both: TOKENS tokens of width DIM, EXPERTS experts of HIDDEN, each token to its TOP_K
(renormalised), fp32, random weights (the router N(0, 1/sqrt(dim)) so that the tokens spread,
the experts N(0, 0.02)), inputs N(0, 1); a step is the forward, the output against a fixed random
gradient, and the backward into the input and every parameter. Rounds alternate flowrun /
transformers, each a process of its own; a round's figure is the median step after the warm-up;
the ratio is the median of the rounds' ratios (transformers' ms over flowrun's) with their
min-max.

  cmake --build build --target moe_bench
  PYTHONPATH=.cache/hf-transformers .venv/bin/python bench/moe_peers.py [--tokens 2048 --dim 1024
      --hidden 512 --experts 64 --top-k 8 --rounds 5 --steps 5 --warmup 2 --threads 2]
"""
import argparse
import os
import statistics
import subprocess
import sys

SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hf_round(a):
    """One round of the peer, in this process's child: prints the median ms."""
    code = r'''
import statistics, sys, time, torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
tokens, dim, hidden, experts, top_k, steps, warmup, threads = map(int, sys.argv[1:9])
torch.set_num_threads(threads)
torch.manual_seed(0)
cfg = Qwen3MoeConfig(hidden_size=dim, moe_intermediate_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                     norm_topk_prob=True)
cfg._experts_implementation = sys.argv[9]
block = Qwen3MoeSparseMoeBlock(cfg).float().train()
with torch.no_grad():
    block.gate.weight.normal_(0, dim ** -0.5)
    block.experts.gate_up_proj.normal_(0, 0.02)
    block.experts.down_proj.normal_(0, 0.02)
x0, dy = torch.randn(1, tokens, dim), torch.randn(1, tokens, dim)
ms = []
for s in range(warmup + steps):
    x = x0.clone().requires_grad_()
    block.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    y = block(x)
    (y * dy).sum().backward()
    t1 = time.perf_counter()
    if s >= warmup:
        ms.append(1e3 * (t1 - t0))
print("median_ms %.3f" % statistics.median(ms))
'''
    args = [str(v) for v in (a.tokens, a.dim, a.hidden, a.experts, a.top_k, a.steps, a.warmup, a.threads)] + [a.experts_impl]
    p = subprocess.run([sys.executable, "-c", code] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.exit("transformers' round failed:\n" + p.stdout[-3000:])
    return float(p.stdout.split("median_ms")[1].split()[0])


def flowrun_round(a):
    args = [str(v) for v in (a.tokens, a.dim, a.hidden, a.experts, a.top_k, a.steps, a.warmup, a.threads)]
    p = subprocess.run([a.bench] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=SRC)
    if p.returncode != 0:
        sys.exit("moe_bench failed:\n" + p.stdout[-3000:])
    out = p.stdout.split()
    return float(out[out.index("median_ms") + 1]), float(out[out.index("balance") + 1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default=os.path.join(SRC, "build", "bench", "moe_bench"))
    for name, default in (("tokens", 2048), ("dim", 1024), ("hidden", 512), ("experts", 64), ("top-k", 8),
                          ("rounds", 5), ("steps", 5), ("warmup", 2), ("threads", 2)):
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--experts-impl", default="eager", choices=["eager", "grouped_mm", "batched_mm"],
                    help="transformers' experts implementation (config._experts_implementation): eager, the issue's "
                         "peer and what a block built alone runs; grouped_mm, what from_pretrained picks where "
                         "torch has torch._grouped_mm")
    a = ap.parse_args()
    if not os.path.exists(a.bench):
        sys.exit("no %s: cmake --build build --target moe_bench" % a.bench)
    import torch
    import transformers

    print("torch %s, transformers %s" % (torch.__version__, transformers.__version__), flush=True)
    fl, hf, ratios = [], [], []
    for r in range(a.rounds):
        ms, balance = flowrun_round(a)
        peer = hf_round(a)
        fl.append(ms), hf.append(peer), ratios.append(peer / ms)
        print("round %d: flowrun %.1f ms, transformers %.1f ms (%.2fx; routing balance %.2f)"
              % (r + 1, ms, peer, peer / ms, balance), flush=True)
    print("| tokens | dim | expert width | experts, top k | transformers Qwen3MoeSparseMoeBlock (experts) | flowrun moe | ratio (min-max) |")
    print("|---|---|---|---|---|---|---|")
    print("| %d | %d | %d | %d, %d | %.1f ms (%s) | %.1f ms | **%.2f x** (%.2f-%.2f) |"
          % (a.tokens, a.dim, a.hidden, a.experts, a.top_k, statistics.median(hf), a.experts_impl, statistics.median(fl),
             statistics.median(ratios), min(ratios), max(ratios)))


if __name__ == "__main__":
    main()
