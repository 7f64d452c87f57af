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
  lora   a LoRA fine-tune of one folder (the config saved by save_pretrained into a temporary
         folder): `flowrun graphs/llama_lora.yaml model.pretrained=FOLDER` vs the loop over
         LlamaForCausalLM.from_pretrained(FOLDER) with peft's get_peft_model (rank 8, alpha 16, the
         same seven target projections), AdamW over the adapters
  ddp    2 processes of 1 thread, global batch 8: `mpirun -np 2 flowrun graphs/llama.yaml` vs the
         loop under DistributedDataParallel (gloo)
  tp     2 processes of 1 thread, each the whole batch: `mpirun -np 2 flowrun ... run.parallel.tp=2`
         vs DTensor's tensor parallel (parallelize_module: q, k, v, gate, up column-wise, o and down
         row-wise, torchtitan's Llama plan) over the same LlamaForCausalLM (gloo)
  sft    issue 71: supervised fine-tuning of a folder with Qwen 3's vocabulary (151,669) on packed
         conversations: `flowrun graphs/llama_sft.yaml model.pretrained=FOLDER` (the chat shards of
         scripts/data.sh, packed best-fit decreasing into rows of 256, the loss on the answers only:
         36 % of the tokens) vs what TRL's SFTTrainer runs with packing and padding_free: peft's
         LoRA on LlamaForCausalLM.from_pretrained(FOLDER), each row's conversations told apart by
         position_ids that restart (transformers then masks attention per conversation), the
         labels -100 outside the answers, the loss summed over the answers' tokens over their
         count; rows of the same shape and the same share of answer tokens (random ids: the speed
         of a step does not depend on them)

Rounds alternate flowrun / transformers; each figure is the median over rounds of per-step medians
(start-up and --warmup steps excluded); the ratio is the median of the rounds' ratios with their
min–max (transformers' seconds over flowrun's: above 1, flowrun is faster). The peer trains on
random tokens, flowrun on the fortunes byte shards of scripts/data.sh: the speed of a step does not
depend on the tokens. The allocator settings and the libtorch check are cpu_peers.py's.

  moe_ep 2 processes of 1 thread, global batch 8, the `moe` model: `mpirun -np 2 flowrun graphs/llama.yaml
         model.pretrained=FOLDER run.parallel.ep=EP` (--ep: 2, each rank half the experts, the tokens
         exchanged by all-to-alls; 1, data parallel) vs Qwen3MoeForCausalLM.from_pretrained(FOLDER)
         under DistributedDataParallel (gloo): what a user of transformers runs on 2 ranks (it has
         no expert parallel of its own)

  .venv/bin/pip install --target .cache/hf-transformers transformers==5.17.0
  PYTHONPATH=.cache/hf-transformers:.cache/hf-peft .venv/bin/python bench/llama_peers.py [--mode eager|lora|ddp|tp|sft] [--rounds 5]
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_peers import same_libtorch, same_malloc  # noqa: E402
from torch_peers import _spawn, flowrun_round, make_optimizer, rounds_ratio, timed_steps  # noqa: E402

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


def hf_config(cfg):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["dim"], intermediate_size=cfg["mlp_dim"],
                       num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                       num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["context"],
                       tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


def hf_model(cfg):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(hf_config(cfg)).train()


def hf_round(cfg, steps, warmup, window, threads):
    import torch

    torch.set_num_threads(threads)
    model = hf_model(cfg)
    return statistics.median(timed_steps(HfLoss(model), model, make_optimizer(model, "cpu"), cfg, "cpu", steps,
                                         warmup, window))


LORA = dict(rank=8, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def save_folder(cfg, path):
    """The bench's model as save_pretrained writes it: what both sides of `lora` fine-tune."""
    hf_model(cfg).save_pretrained(path)


def lora_overrides(folder, cfg, steps, window, threads):
    return ["graphs/llama_lora.yaml", "model.pretrained=" + folder, "data.path=data/text/fortunes_byte",
            "data.batch=%d" % cfg["batch"], "data.seq_len=%d" % cfg["context"], "model.lora.rank=%d" % LORA["rank"],
            "model.lora.alpha=%d" % LORA["alpha"], "opt.weight_decay=0.1", "run.steps=%d" % steps,
            "run.log_every=%d" % window, "eval.every=1000000", "evlog.every=1000000", "ckpt.every=1000000",
            "ckpt.at=[]", "run.threads=%d" % threads]


def peft_round(folder, cfg, steps, warmup, window, threads):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.set_num_threads(threads)
    base = LlamaForCausalLM.from_pretrained(folder).train()
    model = get_peft_model(base, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=LORA["targets"],
                                            lora_dropout=0.0))
    return statistics.median(timed_steps(HfLoss(model), model, make_optimizer(model, "cpu"), cfg, "cpu", steps,
                                         warmup, window))


SFT = dict(CFG, vocab=151669)

# issue 73: a mixture of experts (Qwen 3 MoE's layout). `moe`: a small model whose step is mostly its
# experts (64 experts, top 8, 2048 tokens a step, a small vocabulary); `moe_lm`: the same blocks
# under a 32000 vocabulary, as a small language model is.
MOE = dict(CFG, layers=2, heads=8, kv_heads=2, mlp_dim=688, vocab=512, experts=64, top_k=8, expert_dim=128)
MOE_LM = dict(MOE, layers=4, vocab=32000)


def save_moe_folder(cfg, path):
    """A Qwen3MoeForCausalLM of that size as save_pretrained writes it (its experts one by one):
    what both sides load."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    c = Qwen3MoeConfig(vocab_size=cfg["vocab"], hidden_size=cfg["dim"], intermediate_size=cfg["mlp_dim"],
                       num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                       num_key_value_heads=cfg["kv_heads"], head_dim=cfg["dim"] // cfg["heads"],
                       max_position_embeddings=cfg["context"], tie_word_embeddings=True, num_experts=cfg["experts"],
                       num_experts_per_tok=cfg["top_k"], moe_intermediate_size=cfg["expert_dim"], norm_topk_prob=True,
                       use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    Qwen3MoeForCausalLM(c).save_pretrained(path)


def moe_overrides(folder, cfg, steps, window, threads):
    return ["graphs/llama.yaml", "model.pretrained=" + folder, "data.path=data/text/fortunes_byte",
            "data.batch=%d" % cfg["batch"], "data.seq_len=%d" % cfg["context"], "model.layers=%d" % cfg["layers"],
            "model.dim=%d" % cfg["dim"], "model.heads=%d" % cfg["heads"], "model.kv_heads=%d" % cfg["kv_heads"],
            "model.mlp_dim=%d" % cfg["mlp_dim"], "model.vocab=%d" % cfg["vocab"], "model.context=%d" % cfg["context"],
            "model.tie_embeddings=true", "run.steps=%d" % steps,
            "run.log_every=%d" % window, "eval.every=1000000", "evlog.every=1000000", "ckpt.every=1000000",
            "ckpt.at=[]", "run.threads=%d" % threads]


def moe_round(folder, cfg, steps, warmup, window, threads):
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.set_num_threads(threads)
    model = Qwen3MoeForCausalLM.from_pretrained(folder).train()
    return statistics.median(timed_steps(HfLoss(model), model, make_optimizer(model, "cpu"), cfg, "cpu", steps,
                                         warmup, window))


def sft_overrides(folder, cfg, steps, window, threads):
    return ["graphs/llama_sft.yaml", "model.pretrained=" + folder, "data.batch=%d" % cfg["batch"],
            "data.seq_len=%d" % cfg["context"], "model.lora.rank=%d" % LORA["rank"], "model.lora.alpha=%d" % LORA["alpha"],
            "opt.weight_decay=0.1", "run.steps=%d" % steps, "run.log_every=%d" % window, "eval.every=1000000",
            "evlog.every=1000000", "gen.every=1000000", "ckpt.every=1000000", "ckpt.at=[]", "run.threads=%d" % threads]


def sft_round(folder, cfg, steps, warmup, window, threads):
    """TRL's SFT step with packing and padding_free, as a loop: rows of conversations ~46 tokens long
    (the chat shards' mean), position_ids restarting at each, 36 % of the targets counted."""
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.set_num_threads(threads)
    base = LlamaForCausalLM.from_pretrained(folder).train()
    model = get_peft_model(base, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=LORA["targets"],
                                            lora_dropout=0.0))
    B, T = cfg["batch"], cfg["context"]
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(8):
        ids = torch.randint(0, cfg["vocab"], (B, T + 1), generator=g)
        pos = torch.zeros(B, T, dtype=torch.long)
        labels = torch.full((B, T), -100, dtype=torch.long)
        for b in range(B):
            at = 0
            while at < T:
                n = min(int(torch.randint(20, 72, (1,), generator=g)), T - at)  # a conversation
                pos[b, at:at + n] = torch.arange(n)
                answer = int(0.64 * n)  # its answer: the last 36 %
                labels[b, at + answer:at + n] = ids[b, at + answer + 1:at + n + 1]
                at += n
        batches.append((ids[:, :-1], pos, labels))
    opt = make_optimizer(model, "cpu")

    class Step:
        i = 0

        def __call__(self, idx, targets):
            inputs, pos, labels = batches[Step.i % 8]
            Step.i += 1
            logits = model(input_ids=inputs, position_ids=pos).logits
            counted = (labels != -100).sum()
            return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100,
                                   reduction="sum") / counted

    return statistics.median(timed_steps(Step(), model, opt, cfg, "cpu", steps, warmup, window))


def _ddp_worker(rank, world, port, cfg, steps, warmup, window, threads, out):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    local = dict(cfg, batch=cfg["batch"] // world)  # the global batch split over the ranks
    model = hf_model(local)
    ddp = DDP(model)
    times = timed_steps(HfLoss(ddp), model, make_optimizer(model, "cpu"), local, "cpu", steps, warmup, window, rank)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def _moe_ddp_worker(rank, world, port, folder, cfg, steps, warmup, window, threads, out):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import Qwen3MoeForCausalLM

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    local = dict(cfg, batch=cfg["batch"] // world)
    model = Qwen3MoeForCausalLM.from_pretrained(folder).train()
    ddp = DDP(model)
    times = timed_steps(HfLoss(ddp), model, make_optimizer(model, "cpu"), local, "cpu", steps, warmup, window, rank)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def _tp_worker(rank, world, port, cfg, steps, warmup, window, threads, out):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import torch_peers

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = hf_model(cfg)
    for layer in model.model.layers:  # torchtitan's Llama plan for the blocks (embedding and head whole)
        parallelize_module(layer, mesh, {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                                         "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                                         "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                                         "mlp.down_proj": RowwiseParallel()})
    torch.nn.utils.clip_grad_norm_ = torch_peers.tp_clip_grad_norm_  # split gradients' norm summed over the ranks
    times = timed_steps(HfLoss(model), model, torch_peers.TpAdamW(model), cfg, "cpu", steps, warmup, window, rank=0)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def main():
    same_malloc()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["eager", "lora", "ddp", "tp", "sft", "moe", "moe_lm", "moe_ep"], default="eager")
    ap.add_argument("--ep", type=int, default=2, help="moe_ep: flowrun's run.parallel.ep (1: data parallel)")
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
    mpi = ["mpirun", "--oversubscribe", "-np", "2", "--bind-to", "none"] + (["--allow-run-as-root"] if os.getuid() == 0 else [])
    tmp = tempfile.mkdtemp(prefix="llama-peers-")
    if args.mode == "lora":
        save_folder(CFG, os.path.join(tmp, "base"))
    if args.mode == "sft":
        save_folder(SFT, os.path.join(tmp, "base"))
    moe_cfg = MOE_LM if args.mode == "moe_lm" else MOE
    if args.mode in ("moe", "moe_lm", "moe_ep"):
        save_moe_folder(moe_cfg, os.path.join(tmp, "base"))
    fl, hf = [], []
    for r in range(args.rounds):
        if args.mode == "eager":
            sec, cmd = flowrun_round(args.flowrun, llama_overrides(CFG, args.steps, args.window, args.threads), args.warmup)
            peer = lambda: hf_round(CFG, args.steps, args.warmup, args.window, args.threads)  # noqa: E731
        elif args.mode == "lora":
            folder = os.path.join(tmp, "base")
            sec, cmd = flowrun_round(args.flowrun, lora_overrides(folder, CFG, args.steps, args.window, args.threads),
                                     args.warmup)
            peer = lambda: peft_round(folder, CFG, args.steps, args.warmup, args.window, args.threads)  # noqa: E731
        elif args.mode == "sft":
            folder = os.path.join(tmp, "base")
            sec, cmd = flowrun_round(args.flowrun, sft_overrides(folder, SFT, args.steps, args.window, args.threads), args.warmup)
            peer = lambda: sft_round(folder, SFT, args.steps, args.warmup, args.window, args.threads)  # noqa: E731
        elif args.mode in ("moe", "moe_lm"):
            folder = os.path.join(tmp, "base")
            sec, cmd = flowrun_round(args.flowrun, moe_overrides(folder, moe_cfg, args.steps, args.window, args.threads),
                                     args.warmup)
            peer = lambda: moe_round(folder, moe_cfg, args.steps, args.warmup, args.window, args.threads)  # noqa: E731
        elif args.mode == "moe_ep":  # 2 processes of 1 thread, the global batch split
            folder = os.path.join(tmp, "base")
            more = ["data.batch=%d" % (moe_cfg["batch"] // 2), "run.parallel.ep=%d" % args.ep]
            sec, cmd = flowrun_round(args.flowrun, moe_overrides(folder, moe_cfg, args.steps, args.window, 1) + more,
                                     args.warmup, launcher=mpi)
            peer = lambda: _spawn(_moe_ddp_worker, 2, (folder, moe_cfg, args.steps, args.warmup, args.window, 1),  # noqa: E731
                                  "DDP")
        else:  # ddp, tp: 2 processes of 1 thread
            more = ["data.batch=%d" % (CFG["batch"] // 2)] if args.mode == "ddp" else ["run.parallel.tp=2"]
            sec, cmd = flowrun_round(args.flowrun, llama_overrides(CFG, args.steps, args.window, 1) + more, args.warmup,
                                     launcher=mpi)
            worker = _ddp_worker if args.mode == "ddp" else _tp_worker
            peer = lambda: _spawn(worker, 2, (CFG, args.steps, args.warmup, args.window, 1), args.mode)  # noqa: E731
        if r == 0:
            print("flowrun: " + cmd, flush=True)
        fl.append(sec)
        hf.append(peer())
        print("round %d: flowrun %.1f ms/step, peer %.1f ms/step" % (r + 1, 1e3 * fl[-1], 1e3 * hf[-1]), flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    peers = {"eager": "transformers LlamaForCausalLM", "lora": "transformers + peft LoRA",
             "sft": "transformers + peft, packed (TRL's padding_free)",
             "ddp": "LlamaForCausalLM under DDP, 2 ranks", "tp": "LlamaForCausalLM under DTensor tp 2",
             "moe": "transformers Qwen3MoeForCausalLM", "moe_lm": "transformers Qwen3MoeForCausalLM",
             "moe_ep": "Qwen3MoeForCausalLM under DDP, 2 ranks"}
    print("| mode | config | %s | flowrun llama | speed ratio (min–max) |" % peers[args.mode])
    print("|---|---|---|---|---|")
    shown = SFT if args.mode == "sft" else moe_cfg if args.mode in ("moe", "moe_lm", "moe_ep") else CFG
    print("| %s | %s | %.1f ms | %.1f ms | %s |" % (args.mode + (" (ep %d)" % args.ep if args.mode == "moe_ep" else ""), ", ".join("%s=%s" % kv for kv in shown.items()),
                                               1e3 * statistics.median(hf), 1e3 * statistics.median(fl),
                                               rounds_ratio(hf, fl)))


if __name__ == "__main__":
    main()
