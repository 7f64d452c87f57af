#!/usr/bin/env python3
"""HunyuanDiT-v1.2 at its real size on one GPU (issue 33): graphs/hydit_v12_lora.yaml against the
PyTorch loop a diffusers user writes (HunyuanDiT2DModel + peft LoRA), at the same settings, in one
run: seconds per step and peak GPU memory.

The pipeline folder (--pipeline, made here unless it exists): HunyuanDiT-v1.2-Diffusers' layout and
config.json sizes with random weights, saved by the libraries' own classes and save_pretrained
(diffusers' HunyuanDiT2DModel and AutoencoderKL; transformers' BertModel and T5EncoderModel with an
MT5Config), weights stored in bf16 (both sides upcast them to fp32 where they compute in fp32):
  transformer     HunyuanDiT2DModel, v1.2's config: 40 blocks x 1408 (16 heads of 88), mlp_ratio
                  4.3637, learn_sigma, BERT stream 1024 wide x 77, mT5 stream 2048 wide x 256 with
                  its pooler, no size/style conditioning (1.5B parameters)
  vae             AutoencoderKL in SDXL's shape (the VAE HunyuanDiT uses): 4 blocks [128, 256, 512,
                  512], 2 resnets each, scaling_factor 0.13025
  text_encoder    BertModel of chinese-roberta-wwm-ext-large's shape: 24 x 1024, 16 heads, ffn 4096,
                  vocab 47020
  text_encoder_2  mT5-XL's encoder: 24 x 2048, 32 heads of 64, gated-GELU ffn 5120, vocab 250112
  tokenizer       vocab.txt: the words of the data's captions (flowrun prep shapes' vocabulary)
  tokenizer_2     spiece.model trained on the captions with spm_train (Debian's sentencepiece,
                  unpacked from third_party/debs by tests/gpu/run.sh; --spm-train)
Data (--data, made here unless it exists): 1024 x 1024 shapes images with captions, `flowrun prep
shapes` + `flowrun prep images`: one aspect-ratio bucket.

Settings, the graph's (graphs/hydit_v12_lora.yaml) on both sides: batch 1 at 1024 px (128 x 128
latents, 4096 tokens), the VAE encoder in fp32 sampling the posterior, BERT (77 tokens) and mT5 (256
tokens) in bf16, the DiT in fp32 master weights under bf16 autocast with every block recomputed in
backward (the graph's `checkpoint: blocks`; the loop wraps each of transformer.blocks in
torch.utils.checkpoint, non-reentrant, since diffusers' HunyuanDiT2DModel has no gradient
checkpointing of its own), LoRA rank 64, alpha 64 on to_q, to_k, to_v, to_out.0 (peft's
inject_adapter_in_model), AdamW lr 1e-4 with 100 warm-up steps (fused in the loop), clip 1.0,
v-prediction on the scaled-linear schedule (beta 0.00085 .. 0.03), condition dropout 0.1 per stream
(zeroed embeddings, full masks, as flowrun's null condition), RoPE positions as the pipeline
computes them (get_resize_crop_region_for_grid onto the 32 x 32 grid, get_2d_rotary_pos_embed).
The loop tokenizes as flowrun does (bench/torch_dit.py's WordPiece, the captions' spm_encode ids),
in its DataLoader workers.

Figures: seconds per step, the median over windows of --window steps after --warmup steps (one host
sync per window, start-up and loading excluded), medians over rounds; each round runs flowrun, then
the loop (then, with --inline, flowrun with its encoders inline: the encode stream's worth). The ratio: the loop's s/step over flowrun's (> 1: flowrun faster). Peak GPU memory: the
caching allocator's allocated peak (flowrun's end-of-run line; torch.cuda.max_memory_allocated).

  python3 bench/gpu_hydit.py --flowrun build-gpu/engine/flowrun --diffusers DIFFUSERS_SRC \\
      --out build-gpu/gpu-results/bench_hydit.md
  python3 bench/gpu_hydit.py --tiny ...   # tiny sizes at 64 px, 6 steps: a smoke test of the script

Needs: PyTorch with CUDA, transformers, peft, safetensors, PIL; diffusers (installed, or its source
folder SRC with SRC/diffusers/__init__.py by --diffusers, or a .tar.xz of that folder).
"""
import argparse
import gc
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_dit import ShapesShards, WordPiece, forever  # noqa: E402  (bench/torch_dit.py)
from torch_peers import flowrun_timed, peak_memory, rounds_ratio, write_report  # noqa: E402

FAILED = []
# --inline: the graph's encoders (VAE, BERT, mT5 on `encode`, data on `io`) run inline, on the default
# stream, with the graph's prefetch (2) kept: what the streams alone are worth.
INLINE = ["vae.stream=default", "text.stream=default", "t5.stream=default", "data.stream=default"]

# HunyuanDiT-v1.2-Diffusers' config.json sizes; --tiny: the same structure, small.
V12 = dict(
    transformer=dict(num_attention_heads=16, attention_head_dim=88, in_channels=4, patch_size=2,
                     activation_fn="gelu-approximate", sample_size=128, hidden_size=1408, num_layers=40,
                     mlp_ratio=4.3637, learn_sigma=True, cross_attention_dim=1024, norm_type="layer_norm",
                     cross_attention_dim_t5=2048, pooled_projection_dim=1024, text_len=77, text_len_t5=256,
                     use_style_cond_and_image_meta_size=False),
    vae=dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
             up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
             act_fn="silu", latent_channels=4, norm_num_groups=32, sample_size=1024, scaling_factor=0.13025),
    bert=dict(vocab_size=47020, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
              intermediate_size=4096, max_position_embeddings=512, type_vocab_size=2, hidden_act="gelu",
              layer_norm_eps=1e-12),
    mt5=dict(vocab_size=250112, d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_heads=32,
             feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
             layer_norm_epsilon=1e-6, tie_word_embeddings=False),
    size=1024, text_len=77, text_len_t5=256, rank=64)
TINY = dict(
    transformer=dict(V12["transformer"], num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=4,
                     cross_attention_dim=32, cross_attention_dim_t5=24, pooled_projection_dim=16, text_len=8,
                     text_len_t5=8, sample_size=32),
    vae=dict(V12["vae"], down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
             block_out_channels=[8, 16], layers_per_block=1, norm_num_groups=4, sample_size=64),
    bert=dict(V12["bert"], vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=64, max_position_embeddings=16),
    mt5=dict(V12["mt5"], vocab_size=256, d_model=24, d_kv=8, d_ff=32, num_layers=2, num_heads=2),
    size=64, text_len=8, text_len_t5=8, rank=4)
LR, WARMUP, CLIP, COND_DROP, COND_DROP_T5 = 1e-4, 100, 1.0, 0.1, 0.1
BETA_START, BETA_END, TIMESTEPS = 0.00085, 0.03, 1000
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def say(*a):
    print("==", *a, flush=True)


def import_diffusers(src):
    """diffusers: installed, or from a source folder (SRC/diffusers) or a .tar.xz of one."""
    if src and src.endswith((".tar.xz", ".tar.gz", ".tar")):
        dst = tempfile.mkdtemp(prefix="diffusers-src-")
        with tarfile.open(src) as tf:
            tf.extractall(dst)
        src = dst
    if src:
        sys.path.insert(0, os.path.abspath(src))
    import diffusers  # noqa: F401
    return diffusers


# ---- the pipeline folder and the data ----

def tool(args, name):
    """Debian's spm_train / spm_encode: beside --spm-train, on PATH, or in the prefix tests/gpu/run.sh
    unpacked (BUILD/prefix/usr/bin, BUILD being the folder of --flowrun's engine/)."""
    prefix_bin = os.path.join(os.path.dirname(os.path.abspath(args.flowrun)), "..", "prefix", "usr", "bin")
    for d in ([os.path.dirname(args.spm_train)] if args.spm_train else []) + [None, prefix_bin]:
        p = shutil.which(name, path=d)
        if p:
            return os.path.normpath(p)
    raise FileNotFoundError("%s not found: install Debian's sentencepiece (tests/gpu/run.sh unpacks it from "
                            "third_party/debs into build-gpu/prefix) or pass --spm-train" % name)


def make_data(args, cfg):
    """args.data: 1024 px (tiny: 64 px) shapes shards; their captions' vocabulary beside them."""
    if glob.glob(args.data + ".train-*.tar"):
        return
    png = args.data + "-png"
    say("rendering %s (flowrun prep shapes + prep images, %d px)" % (args.data, cfg["size"]))
    subprocess.run([args.flowrun, "prep", "shapes", png, "--set", "base", "--count", str(args.images), "--size",
                    str(cfg["size"]), "--seed", "1"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([args.flowrun, "prep", "images", png, args.data, "--val-fraction", "0", "--seed", "1"], check=True,
                   stdout=subprocess.DEVNULL)


def captions(args):
    return [open(p).read().strip() for p in sorted(glob.glob(args.data + "-png/*.txt")) if not p.endswith("vocab.txt")]


def make_pipeline(args, cfg):
    """args.pipeline: model_index.json and the six components, random weights in cfg's shapes."""
    if os.path.exists(os.path.join(args.pipeline, "model_index.json")):
        return
    from diffusers import AutoencoderKL, HunyuanDiT2DModel
    from transformers import BertConfig, BertModel, MT5Config, T5EncoderModel
    dev = torch.device(args.device)
    out = args.pipeline + ".partial"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    torch.manual_seed(0)

    def save(model, sub, **kw):  # made on the device (fast init), saved in bf16 by the library's save_pretrained
        model.to(torch.bfloat16).save_pretrained(os.path.join(out, sub), **kw)
        n = sum(p.numel() for p in model.parameters())
        say("  %s: %s, %.1fM parameters" % (sub, type(model).__name__, n / 1e6))
        del model
        torch.cuda.empty_cache() if dev.type == "cuda" else None

    with dev:
        save(HunyuanDiT2DModel(**cfg["transformer"]), "transformer")
        save(AutoencoderKL(**cfg["vae"]), "vae")
        save(BertModel(BertConfig(**cfg["bert"]), add_pooling_layer=False), "text_encoder")
        save(T5EncoderModel(MT5Config(**cfg["mt5"])), "text_encoder_2")
    os.makedirs(os.path.join(out, "tokenizer"))
    shutil.copy(args.data + "-png/vocab.txt", os.path.join(out, "tokenizer", "vocab.txt"))
    with open(os.path.join(out, "tokenizer", "tokenizer_config.json"), "w") as f:
        json.dump({"do_lower_case": True}, f)
    os.makedirs(os.path.join(out, "tokenizer_2"))
    text = os.path.join(out, "captions.txt")
    with open(text, "w") as f:
        f.write("\n".join(captions(args)) + "\n")
    subprocess.run([tool(args, "spm_train"), "--input=" + text, "--model_prefix=" + os.path.join(out, "tokenizer_2", "spiece"),
                    "--vocab_size=200", "--hard_vocab_limit=false", "--model_type=unigram", "--pad_id=0", "--eos_id=1",
                    "--unk_id=2", "--bos_id=-1", "--character_coverage=1.0", "--minloglevel=2"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.remove(text)
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump({"_class_name": "HunyuanDiTPipeline", "transformer": ["diffusers", "HunyuanDiT2DModel"],
                   "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "BertModel"],
                   "text_encoder_2": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "BertTokenizer"],
                   "tokenizer_2": ["transformers", "T5Tokenizer"]}, f, indent=2)
    os.rename(out, args.pipeline)
    say("pipeline folder %s made in %.0f s" % (args.pipeline, time.time() - t0))


# ---- flowrun ----

def flowrun_overrides(args, cfg):
    o = ["graphs/hydit_v12_lora.yaml", "run.steps=%d" % args.steps, "run.log_every=%d" % args.window,
         "run.device=" + ("cuda" if args.device.startswith("cuda") else args.device), "sample.every=1000000",
         "sample.at=[]", "ckpt.every=1000000", "ckpt.at=[]", "data.size=%d" % cfg["size"]]
    if args.tiny:
        o += ["data.bucket_step=16", "tok.max_length=%d" % cfg["text_len"], "tok5.max_length=%d" % cfg["text_len_t5"],
              "model.lora.rank=%d" % cfg["rank"], "model.lora.alpha=%d" % cfg["rank"]]
    if not args.device.startswith("cuda"):
        o.append("run.precision=fp32")
    return o


def flowrun_round(args, cfg, facts, extra=()):
    os.environ["HYDIT"], os.environ["HYDIT_DATA"] = args.pipeline, args.data
    try:
        sec, output, cmd = flowrun_timed(args.flowrun, flowrun_overrides(args, cfg) + list(extra), args.warmup,
                                         args.run_timeout)
    except RuntimeError as e:  # go on: the loop's figure still comes
        print("flowrun failed: %s" % e, file=sys.stderr, flush=True)
        FAILED.append("flowrun")
        return None
    if peak_memory(output):
        facts["peak"] = peak_memory(output)
    m = re.search(r"\(dit\): ([0-9.]+M parameters(?:, [0-9.]+M trainable)?)", output)
    if m:
        facts["dit"] = m.group(1)
    if not extra:
        facts["cmd"] = cmd
        facts["log"] = "\n".join(l for l in output.splitlines() if "parameters" in l or "peak" in l)[-2000:]
    return sec


# ---- the PyTorch loop: diffusers + peft ----

class Collate:
    """Images stacked; the captions tokenized as flowrun does (BERT: WordPiece over vocab.txt; mT5:
    the captions' SentencePiece ids, computed once by spm_encode, + </s>, padded with 0)."""

    def __init__(self, vocab, text_len, t5_ids, text_len_t5):
        self.wp, self.t5_ids, self.L5 = WordPiece(vocab, text_len), t5_ids, text_len_t5

    def __call__(self, rows):
        ids, mask = self.wp([c for _, c in rows])
        ids5 = torch.zeros((len(rows), self.L5), dtype=torch.long)
        mask5 = torch.zeros_like(ids5)
        for b, (_, c) in enumerate(rows):
            row = self.t5_ids[c][:self.L5 - 1] + [1]
            ids5[b, :len(row)], mask5[b, :len(row)] = torch.tensor(row), 1
        return torch.stack([x for x, _ in rows]), ids, mask, ids5, mask5


def t5_ids(args, caps):
    p = subprocess.run([tool(args, "spm_encode"), "--model=" + os.path.join(args.pipeline, "tokenizer_2", "spiece.model"),
                        "--output_format=id"], input="\n".join(caps) + "\n", text=True, stdout=subprocess.PIPE, check=True)
    return {c: [int(t) for t in l.split()] for c, l in zip(caps, p.stdout.splitlines())}


def checkpoint_blocks(transformer):
    """Each block recomputed in backward (what `checkpoint: blocks` does in flowrun)."""
    from torch.utils.checkpoint import checkpoint
    for block in transformer.blocks:
        fwd = block.forward
        block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(fwd)


def loop_setup(args, cfg):
    from diffusers import AutoencoderKL, HunyuanDiT2DModel
    from diffusers.models.embeddings import get_2d_rotary_pos_embed
    from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import BertModel, T5EncoderModel
    dev = torch.device(args.device)
    bf16 = dev.type == "cuda"
    p = args.pipeline
    dit = HunyuanDiT2DModel.from_pretrained(p, subfolder="transformer").to(dev, torch.float32)
    vae = AutoencoderKL.from_pretrained(p, subfolder="vae").to(dev, torch.float32).eval()
    enc_dtype = torch.bfloat16 if bf16 else torch.float32
    bert = BertModel.from_pretrained(p, subfolder="text_encoder", add_pooling_layer=False).to(dev, enc_dtype).eval()
    t5 = T5EncoderModel.from_pretrained(p, subfolder="text_encoder_2").to(dev, enc_dtype).eval()
    for m in (dit, vae, bert, t5):
        m.requires_grad_(False)
    dit = inject_adapter_in_model(LoraConfig(r=cfg["rank"], lora_alpha=cfg["rank"], target_modules=TARGETS), dit)
    lora = [q for n, q in dit.named_parameters() if "lora_" in n]
    for q in lora:
        q.requires_grad_(True)
    dit.train()
    checkpoint_blocks(dit)
    opt = torch.optim.AdamW(lora, lr=LR, weight_decay=0.0, **({"fused": True} if dev.type == "cuda" else {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / WARMUP))
    caps = captions(args)
    loader = torch.utils.data.DataLoader(
        ShapesShards(args.data, "train", cfg["size"]), batch_size=args.batch, shuffle=True, drop_last=True,
        num_workers=args.workers, persistent_workers=args.workers > 0, pin_memory=dev.type == "cuda",
        collate_fn=Collate(os.path.join(p, "tokenizer", "vocab.txt"), cfg["text_len"], t5_ids(args, caps),
                           cfg["text_len_t5"]))
    f = 2 ** (len(cfg["vae"]["block_out_channels"]) - 1)  # the VAE's downsampling
    grid = cfg["size"] // f // cfg["transformer"]["patch_size"]
    crops = get_resize_crop_region_for_grid((grid, grid), 512 // 8 // cfg["transformer"]["patch_size"])
    try:  # diffusers >= 0.32 (the pipeline's call)
        rope = get_2d_rotary_pos_embed(cfg["transformer"]["attention_head_dim"], crops, (grid, grid), device=dev,
                                       output_type="pt")
    except TypeError:  # older: no device, output_type
        rope = get_2d_rotary_pos_embed(cfg["transformer"]["attention_head_dim"], crops, (grid, grid))
    rope = tuple(r.to(dev) for r in rope)
    betas = torch.linspace(BETA_START ** 0.5, BETA_END ** 0.5, TIMESTEPS, dtype=torch.float64) ** 2
    ab = torch.cumprod(1 - betas, 0).float().to(dev)
    n_lora = sum(q.numel() for q in lora)
    n_dit = sum(q.numel() for q in dit.parameters())
    return dict(dit=dit, vae=vae, bert=bert, t5=t5, opt=opt, sched=sched, lora=lora, batches=forever(loader),
                rope=rope, ab=ab, bf16=bf16, n_lora=n_lora, n_dit=n_dit)


def loop_step(L, dev):
    images, ids, mask, ids5, mask5 = (x.to(dev, non_blocking=True) for x in next(L["batches"]))
    with torch.no_grad():
        sf = L["vae"].config.scaling_factor
        x0 = L["vae"].encode(images).latent_dist.sample() * sf
        emb = L["bert"](input_ids=ids, attention_mask=mask).last_hidden_state.float()
        emb5 = L["t5"](input_ids=ids5, attention_mask=mask5).last_hidden_state.float()
    B = x0.shape[0]
    t = torch.randint(0, TIMESTEPS, (B,), device=dev)
    noise = torch.randn_like(x0)
    a = L["ab"][t].view(B, 1, 1, 1)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
    v = a.sqrt() * noise - (1 - a).sqrt() * x0
    drop = torch.rand(B, device=dev) < COND_DROP  # the null condition: zeroed embeddings, full masks
    drop5 = torch.rand(B, device=dev) < COND_DROP_T5
    emb = torch.where(drop.view(B, 1, 1), torch.zeros_like(emb), emb)
    mask = torch.where(drop.view(B, 1), torch.ones_like(mask), mask)
    emb5 = torch.where(drop5.view(B, 1, 1), torch.zeros_like(emb5), emb5)
    mask5 = torch.where(drop5.view(B, 1), torch.ones_like(mask5), mask5)
    with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=L["bf16"]):
        out = L["dit"](xt, t.float(), encoder_hidden_states=emb, text_embedding_mask=mask,
                       encoder_hidden_states_t5=emb5, text_embedding_mask_t5=mask5, image_rotary_emb=L["rope"],
                       return_dict=False)[0]
    pred = out[:, :x0.shape[1]]  # learn_sigma: the first half is the prediction
    loss = F.mse_loss(pred.float(), v.float())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(L["lora"], CLIP)
    L["opt"].step()
    L["sched"].step()
    L["opt"].zero_grad(set_to_none=True)
    return loss


def loop_round(args, cfg, facts):
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        L = loop_setup(args, cfg)
        facts["loop_params"] = "%.1fM (LoRA %.2fM trainable)" % (L["n_dit"] / 1e6, L["n_lora"] / 1e6)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        times, t0 = [], None
        for step in range(args.steps):
            if step == args.warmup:
                sync()
                t0 = time.perf_counter()
            loss = loop_step(L, dev)
            if step >= args.warmup and (step + 1 - args.warmup) % args.window == 0:
                loss.item()  # one host sync per window, as flowrun's metrics
                t1 = time.perf_counter()
                times.append((t1 - t0) / args.window)
                t0 = t1
        sec = statistics.median(times)
    except Exception as e:
        traceback.print_exc()
        print("PyTorch loop failed: %s: %s" % (type(e).__name__, e), file=sys.stderr, flush=True)
        FAILED.append("PyTorch loop")
        sec = None
    if dev.type == "cuda":
        facts.setdefault("loop_peak", []).append(torch.cuda.max_memory_allocated())
    L = None
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return sec


# ---- the report ----

def table(args, res, facts):
    fl, pt, il = ([x for x in res[k] if x is not None] for k in ("flowrun", "loop", "inline"))
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    s = lambda xs: "%.3f" % statistics.median(xs) if xs else "-"  # noqa: E731
    peak = facts.get("loop_peak")
    return [
        "# HunyuanDiT-v1.2 size, 1024 px LoRA: flowrun vs diffusers + peft", "",
        "device: %s; torch %s; %s%s" % (name, torch.__version__, time.strftime("%Y-%m-%d"),
                                        "; TINY smoke sizes" if args.tiny else ""), "",
        "Settings: bench/gpu_hydit.py's docstring (the graph's: batch %d, bf16 autocast, blocks recomputed, LoRA "
        "rank %d on %s, AdamW, clip 1.0). Parameters: flowrun's DiT %s; the loop's %s." % (
            args.batch, (TINY if args.tiny else V12)["rank"], ", ".join(TARGETS), facts.get("dit", "?"),
            facts.get("loop_params", "?")), "",
        "| | s/step | peak GPU memory |", "|---|---|---|",
        "| flowrun graphs/hydit_v12_lora.yaml | %s | %s |" % (s(fl), facts.get("peak", "-")),
        "| PyTorch loop: diffusers HunyuanDiT2DModel + peft LoRA (torch.utils.checkpoint per block, fused AdamW) | %s | %s |"
        % (s(pt), "%.1f GB" % (max(peak) / 1e9) if peak else "-"), "",
        "flowrun / PyTorch speed (the loop's s/step over flowrun's; > 1: flowrun faster) = %s." %
        rounds_ratio(res["loop"], res["flowrun"]), "",
        "flowrun with its encoders inline (`%s`): %s s/step; own streams over inline (inline s/step over the "
        "graph's) = %s." % (" ".join(INLINE), s(il), rounds_ratio(res["inline"], res["flowrun"])) if args.inline else
        "(flowrun inline: not run; --inline)", "",
        "Rounds: %d of %d; %d steps per run, per-step time the median of %d-step windows after the first %d steps. "
        "Peak memory: the caching allocator's allocated peak, GB = 10^9 bytes." % (
            len(res["flowrun"]), args.rounds, args.steps, args.window, args.warmup), "",
        "flowrun command: `HYDIT=%s HYDIT_DATA=%s %s`" % (args.pipeline, args.data, facts.get("cmd", "?")), "",
        "flowrun's log:", "", "```", facts.get("log", ""), "```",
    ]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flowrun", default="build-gpu/engine/flowrun")
    ap.add_argument("--diffusers", default=None, help="diffusers' source: a folder holding diffusers/, or its .tar.xz")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes at 64 px, 6 steps, 1 round (a smoke test)")
    ap.add_argument("--pipeline", default=None, help="the pipeline folder (made unless it exists; default "
                                                      "data/hydit_v12_random, --tiny data/hydit_tiny_random)")
    ap.add_argument("--data", default=None, help="shards prefix (made unless it exists; default data/hydit1024/shapes)")
    ap.add_argument("--images", type=int, default=32, help="images rendered for --data")
    ap.add_argument("--spm-train", default=None, help="Debian's spm_train (default: PATH, then build-gpu/prefix/usr/bin)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 16; --tiny 6)")
    ap.add_argument("--warmup", type=int, default=None, help="default 4 (--tiny 2)")
    ap.add_argument("--window", type=int, default=None, help="default 4 (--tiny 2)")
    ap.add_argument("--rounds", type=int, default=None, help="default 2 (--tiny 1)")
    ap.add_argument("--inline", action="store_true", help="also flowrun with its encoders inline (no own streams)")
    ap.add_argument("--workers", type=int, default=4, help="DataLoader workers of the loop")
    ap.add_argument("--run-timeout", type=int, default=300, help="seconds one flowrun run may take")
    ap.add_argument("--out", default=None, help="write the markdown table here too (after each round)")
    args = ap.parse_args()
    d = dict(pipeline="data/hydit_tiny_random", data="data/hydit64/shapes", steps=6, warmup=2, window=2, rounds=1) \
        if args.tiny else dict(pipeline="data/hydit_v12_random", data="data/hydit1024/shapes", steps=16, warmup=4,
                               window=4, rounds=2)
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.batch != 1:
        ap.error("--batch: the graph's batch is 1 (data.batch); other batches are not wired here")
    return args


def main():
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only: no hub lookups
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    cfg = TINY if args.tiny else V12
    try:
        import_diffusers(args.diffusers)
        make_data(args, cfg)
        make_pipeline(args, cfg)
    except Exception as e:
        traceback.print_exc()
        write_report(args.out, ["# HunyuanDiT-v1.2 size", "", "no figure: the setup failed: %s: %s" % (type(e).__name__, e)])
        return 3
    res, facts = {"flowrun": [], "loop": [], "inline": []}, {}
    for r in range(args.rounds):
        res["flowrun"].append(flowrun_round(args, cfg, facts))
        res["loop"].append(loop_round(args, cfg, facts))
        if args.inline:
            res["inline"].append(flowrun_round(args, cfg, facts, INLINE))
        say("round %d: flowrun %s, PyTorch %s, flowrun inline %s s/step" % (
            r + 1, *("-" if not x or x[-1] is None else "%.3f" % x[-1] for x in (res["flowrun"], res["loop"], res["inline"]))))
        text = write_report(args.out, table(args, res, facts))
    print(text)
    if FAILED:
        print("gpu_hydit.py: no figure for: %s (see above)" % ", ".join(sorted(set(FAILED))), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
