#!/usr/bin/env python3
"""flowrun's llama node against transformers' LlamaForCausalLM in a plain PyTorch loop, on this
machine's CPU, in one run (issue 70's speed check).

Config (graphs/llama.yaml by overrides, and the same model as transformers builds it): 4 layers,
256 wide, 8 query heads sharing 2 key/value heads (head 32), SwiGLU 688 wide, vocabulary 32000,
tied head, 256 tokens, batch 8, fp32, rope_theta 500000 without scaling; AdamW (betas 0.9, 0.95,
weight decay 0.1 on matrices), gradient clipping at 1.0, the same threads on both sides.

  eager  one process: `flowrun graphs/llama.yaml ...` vs a loop over LlamaForCausalLM(config)
         (transformers' default attention, SDPA) that computes the same loss (cross-entropy of
         the logits against the next tokens) and steps AdamW

Rounds alternate flowrun / transformers; each figure is the median over rounds of per-step medians
(start-up and --warmup steps excluded); the ratio is the median of the rounds' ratios with their
min–max (transformers' seconds over flowrun's: above 1, flowrun is faster). The peer trains on
random tokens, flowrun on the fortunes byte shards of scripts/data.sh: the speed of a step does not
depend on the tokens. The allocator settings and the libtorch check are cpu_peers.py's.

  .venv/bin/pip install --target .cache/hf-transformers transformers==5.17.0
  PYTHONPATH=.cache/hf-transformers .venv/bin/python bench/llama_peers.py [--rounds 5]
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_peers import same_libtorch, same_malloc  # noqa: E402
from torch_peers import flowrun_round, make_optimizer, rounds_ratio, timed_steps  # noqa: E402

CFG = dict(layers=4, dim=256, heads=8, kv_heads=2, mlp_dim=688, vocab=32000, context=256, batch=8, bf16=False)


def llama_overrides(cfg, steps, window, threads):
    """graphs/llama.yaml as the loop: the same model, batch and optimizer; evaluation and
    checkpoints, which the loop does not have, moved past the last step."""
    return ["graphs/llama.yaml", "data.path=data/text/fortunes_byte", "data.batch=%d" % cfg["batch"],
            "data.seq_len=%d" % cfg["context"], "model.layers=%d" % cfg["layers"], "model.dim=%d" % cfg["dim"],
            "model.heads=%d" % cfg["heads"], "model.kv_heads=%d" % cfg["kv_heads"], "model.mlp_dim=%d" % cfg["mlp_dim"],
            "model.vocab=%d" % cfg["vocab"], "model.context=%d" % cfg["context"], "model.rope_scaling=none",
            "model.rope_theta=500000", "model.tie_embeddings=true", "run.steps=%d" % steps,
            "run.log_every=%d" % window, "eval.every=1000000", "evlog.every=1000000", "ckpt.every=1000000",
            "ckpt.at=[]", "run.threads=%d" % threads]


class HfLoss:
    """LlamaForCausalLM's logits scored as the loop in torch_peers scores GPT's: the mean
    cross-entropy against the next tokens."""

    def __init__(self, model):
        self.model = model

    def __call__(self, idx, targets):
        import torch.nn.functional as F

        logits = self.model(input_ids=idx).logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def hf_round(cfg, steps, warmup, window, threads):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["dim"], intermediate_size=cfg["mlp_dim"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                         num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["context"],
                         tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    model = LlamaForCausalLM(config).train()
    return statistics.median(timed_steps(HfLoss(model), model, make_optimizer(model, "cpu"), cfg, "cpu", steps,
                                         warmup, window))


def main():
    same_malloc()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--malloc", choices=["same", "default"], default="same")
    ap.add_argument("--flowrun", default="build/engine/flowrun")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    same_libtorch(args.flowrun)
    import transformers

    print("transformers %s" % transformers.__version__, flush=True)
    fl, hf = [], []
    for r in range(args.rounds):
        sec, cmd = flowrun_round(args.flowrun, llama_overrides(CFG, args.steps, args.window, args.threads), args.warmup)
        if r == 0:
            print("flowrun: " + cmd, flush=True)
        fl.append(sec)
        hf.append(hf_round(CFG, args.steps, args.warmup, args.window, args.threads))
        print("round %d: flowrun %.1f ms/step, transformers %.1f ms/step" % (r + 1, 1e3 * fl[-1], 1e3 * hf[-1]), flush=True)
    print("| config | transformers LlamaForCausalLM | flowrun llama | speed ratio (min–max) |")
    print("|---|---|---|---|")
    print("| %s | %.1f ms | %.1f ms | %s |" % (", ".join("%s=%s" % kv for kv in CFG.items()),
                                          1e3 * statistics.median(hf), 1e3 * statistics.median(fl),
                                          rounds_ratio(hf, fl)))


if __name__ == "__main__":
    main()
