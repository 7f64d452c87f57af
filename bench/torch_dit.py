"""What users would run instead of flowrun for graphs/dit_base.yaml: the DiT demo's training
loop written as a PyTorch user writes it, and the overrides that make flowrun run the same
config for bench/cpu_peers.py (--config dit_demo).

The loop: a torch.utils.data Dataset over the same tar shards (tarfile + PIL, scaled to [-1, 1]
as image_text_shards does), WordPiece tokenization in the DataLoader's collate, a frozen VAE
encoder (diffusers' AutoencoderKL encoder transcribed from nodes/models/vae.*, no_grad: images to
a posterior sample of the latents times scaling_factor), a frozen BERT (no_grad) and a
HunyuanDiT-style DiT transcribed from nodes/models/bert.* and nodes/models/dit.*
(same layers, widths, attention and parameter count; the DiT also with flowrun's parameter
names, so its checkpoints load with load_state_dict), the diffusion step of
nodes/train/diffusion.cpp (t ~ U{0..999}, noise, v target, MSE; 10 % of captions dropped for
classifier-free guidance), AdamW with clip 1.0 and linear warm-up, and an EMA copy updated every
step with the warm-up of nodes/state/ema.cpp. Initialization follows flowrun's rules but not its
random streams. Per-step times as bench/torch_peers.py: the median over windows of `window`
steps after `warmup` steps, one host sync (loss.item()) per window.
Device and precision (dit_round's `device` and `precision`; the CPU and fp32 by default, as
before): on a GPU the modules are made there, batches come from pinned memory (non_blocking
copies), t and the noise are drawn there, AdamW is fused, and with bf16 the forwards of the DiT
and BERT run under bf16 autocast (fp32 master weights; text states cast to fp32, as flowrun's
encoders give them; the VAE encoder in fp32, as bench/gpu_dit.py's flowrun runs it). bench/gpu_dit.py runs it so at DiT-XL size.
Needs Debian's python3-torch and python3-pil (scripts/setup.sh installs both).

  /usr/bin/python3 bench/torch_dit.py --steps 40               # the loop alone: parameters, s/step
  python3 bench/torch_dit.py --device cuda --precision bf16 --workers 4   # the same on a GPU
  python3 bench/gpu_dit.py                                      # at DiT-XL size on a GPU, against flowrun
  /usr/bin/python3 bench/cpu_peers.py --config dit_demo        # against flowrun
"""
import argparse
import contextlib
import copy
import io
import math
import os
import statistics
import tarfile
import time
import unicodedata

import torch
import torch.nn as nn
import torch.nn.functional as F
try:
    from PIL import Image  # python3-pil
except ImportError:  # the models and dit_overrides still import (bench/gpu_dit.py's flowrun side); the Dataset says so
    Image = None

# graphs/dit_base.yaml, node by node (dit_overrides passes them all to flowrun).
DIT_DEMO = dict(
    batch=32, size=32, max_length=16, vocab_txt="data/shapes/vocab.txt",                       # data, tok
    bert=dict(vocab=128, dim=64, layers=2, heads=4, ffn=128, max_positions=32, seed=7),       # text
    vae=dict(block_out_channels=[16, 32, 32], layers_per_block=1, latent_channels=4, norm_num_groups=8,
             scaling_factor=0.36),                                                            # vae (vae_encode)
    dit=dict(patch=2, in_channels=4, hidden=128, depth=4, heads=4, mlp_ratio=4.0, text_dim=64,
             text_len=16),  # model (t5_dim 0, learn_sigma false, no size/style conditioning; text_len = max_length)
    cond_drop=0.1, timesteps=1000, beta_start=0.00085, beta_end=0.012,                        # fb (scaled_linear, v)
    lr=2e-3, warmup=100, weight_decay=0.0, clip=1.0,                                          # opt (adamw, constant)
    ema_decay=0.999, ema_power=2.0 / 3.0,                                                     # ema (warmup: true)
)


# ---- data: the tar shards, as a Dataset ----

class ShapesShards(torch.utils.data.Dataset):
    """PREFIX.SPLIT-NNNNNN.tar (flowrun prep images, WebDataset layout: members NNNNNN.png and
    NNNNNN.txt share the key, the name up to the first dot of the basename). Indexed once
    (member offsets); an item is read with one seek per member."""

    def __init__(self, prefix, split, size):
        if Image is None:
            raise ImportError("the loop's Dataset decodes PNGs with PIL: install python3-pil (or pip's pillow)")
        d, base = os.path.split(prefix)
        d = d or "."
        head = base + "." + split + "-"
        self.paths = sorted(os.path.join(d, n) for n in os.listdir(d)
                            if n.startswith(head) and n.endswith(".tar") and n[len(head):-4].isdigit())
        if not self.paths:
            raise FileNotFoundError("no shards %s*.tar (scripts/data.sh makes them)" % os.path.join(d, head))
        self.size, self.items, self._files = size, [], {}
        for s, path in enumerate(self.paths):
            groups = {}
            with tarfile.open(path) as tf:
                for m in tf:
                    if not m.isfile():
                        continue
                    dirname, name = os.path.split(m.name)
                    key, _, ext = name.partition(".")
                    groups.setdefault(os.path.join(dirname, key), {})[ext.lower()] = (m.offset_data, m.size)
            for key in sorted(groups):
                g = groups[key]
                img = next((g[e] for e in ("png", "jpg", "jpeg") if e in g), None)
                if img and "txt" in g:
                    self.items.append((s, img, g["txt"]))

    def _read(self, shard, member):
        f = self._files.get(shard)  # one handle per shard and process (each worker opens its own)
        if f is None:
            f = self._files[shard] = open(self.paths[shard], "rb")
        f.seek(member[0])
        return f.read(member[1])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        shard, img, txt = self.items[i]
        im = Image.open(io.BytesIO(self._read(shard, img))).convert("RGB")
        if im.size != (self.size, self.size):  # cover size x size, centre crop (flowrun's resize_center_crop)
            s = max(self.size / im.width, self.size / im.height)
            rw, rh = max(self.size, round(im.width * s)), max(self.size, round(im.height * s))
            im = im.resize((rw, rh), Image.BILINEAR)
            x0, y0 = (rw - self.size) // 2, (rh - self.size) // 2
            im = im.crop((x0, y0, x0 + self.size, y0 + self.size))
        x = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(self.size, self.size, 3)
        x = x.permute(2, 0, 1).float() / 127.5 - 1  # [3, H, W] in [-1, 1], as image_to_tensor
        return x, self._read(shard, txt).decode("utf-8").strip()


class WordPiece:
    """BERT's WordPiece over vocab.txt (id = line): lowercase, accents stripped, punctuation split
    off, greedy longest match with ## continuations; [CLS] pieces [SEP], truncated to max_length,
    padded with [PAD]; attention_mask 1 on tokens (nodes/formats/wordpiece.hpp, text_tokenizer.hpp).
    Without flowrun's CJK and control-character cleaning: the captions are plain lowercase words."""

    def __init__(self, vocab_txt, max_length):
        with open(vocab_txt, encoding="utf-8") as f:
            vocab = [l.rstrip("\r\n") for l in f]
        self.ids = {}
        for i, t in enumerate(vocab):
            self.ids.setdefault(t, i)
        self.max_length = max_length
        self.cls, self.sep, self.pad, self.unk = (self.ids[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[UNK]"))

    def _words(self, text):
        for w in text.split():
            w = "".join(c for c in unicodedata.normalize("NFD", w.lower()) if unicodedata.category(c) != "Mn")
            cur = ""
            for c in w:
                if unicodedata.category(c).startswith("P") or (c.isascii() and not c.isalnum() and c.isprintable()):
                    if cur:
                        yield cur
                    cur = ""
                    yield c
                else:
                    cur += c
            if cur:
                yield cur

    def _pieces(self, word):
        if len(word) > 100:
            return [self.unk]
        out, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start and ("##" if start else "") + word[start:end] not in self.ids:
                end -= 1
            if end == start:
                return [self.unk]
            out.append(self.ids[("##" if start else "") + word[start:end]])
            start = end
        return out

    def __call__(self, texts):
        L = self.max_length
        ids = torch.full((len(texts), L), self.pad, dtype=torch.long)
        mask = torch.zeros((len(texts), L), dtype=torch.long)
        for b, text in enumerate(texts):
            row = [p for w in self._words(text) for p in self._pieces(w)][:L - 2]
            row = [self.cls] + row + [self.sep]
            ids[b, :len(row)] = torch.tensor(row)
            mask[b, :len(row)] = 1
        return ids, mask


def make_loader(cfg, data, split="train", workers=1, pin=False):
    """Shuffled batches of (images, input_ids, attention_mask), tokenized in the worker.
    One worker on a 2-core box: it decodes and tokenizes the next batches while the main
    process trains with the intra-op threads; more workers would only take cores from the math.
    Persistent, so a new epoch does not start a new worker process. pin: batches in pinned
    memory, for non_blocking copies to a GPU."""
    tok = WordPiece(cfg["vocab_txt"], cfg["max_length"])

    def collate(rows):
        ids, mask = tok([c for _, c in rows])
        return torch.stack([x for x, _ in rows]), ids, mask

    return torch.utils.data.DataLoader(ShapesShards(data, split, cfg["size"]), batch_size=cfg["batch"], shuffle=True,
                                       drop_last=True, num_workers=workers, collate_fn=collate,
                                       persistent_workers=workers > 0, pin_memory=pin)


def forever(loader):
    while True:
        yield from loader


# ---- the frozen text encoder: BERT (HF BertModel layout, nodes/models/bert.hpp) ----

class BertEmbeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.word_embeddings = nn.Embedding(c["vocab"], c["dim"])
        self.position_embeddings = nn.Embedding(c["max_positions"], c["dim"])
        self.token_type_embeddings = nn.Embedding(2, c["dim"])
        self.LayerNorm = nn.LayerNorm(c["dim"], eps=1e-12)

    def forward(self, ids):
        pos = torch.arange(ids.size(1), device=ids.device)
        return self.LayerNorm(self.word_embeddings(ids) + self.token_type_embeddings.weight[0] + self.position_embeddings(pos))


class BertLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c["dim"]
        self.h = c["heads"]
        self.query, self.key, self.value, self.attn_out = (nn.Linear(d, d) for _ in range(4))
        self.attn_norm = nn.LayerNorm(d, eps=1e-12)
        self.intermediate = nn.Linear(d, c["ffn"])
        self.output = nn.Linear(c["ffn"], d)
        self.out_norm = nn.LayerNorm(d, eps=1e-12)

    def forward(self, x, bias):
        B, L, D = x.shape
        q, k, v = (m(x).view(B, L, self.h, D // self.h).transpose(1, 2) for m in (self.query, self.key, self.value))
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D // self.h) + bias
        a = self.attn_norm(self.attn_out((s.softmax(-1) @ v).transpose(1, 2).reshape(B, L, D)) + x)
        return self.out_norm(self.output(F.gelu(self.intermediate(a))) + a)  # post-LN, exact GELU


class Bert(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embeddings = BertEmbeddings(c)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c["layers"]))

    def forward(self, ids, mask):
        x = self.embeddings(ids)
        bias = ((1 - mask.to(x.dtype)) * torch.finfo(x.dtype).min)[:, None, None, :]  # HF's extended mask
        for layer in self.layers:
            x = layer(x, bias)
        return x


def make_encoder(c):
    torch.manual_seed(c["seed"])
    enc = Bert(c)
    for m in enc.modules():  # HF's init: N(0, 0.02), biases 0 (LayerNorms keep 1 / 0)
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear):
            nn.init.zeros_(m.bias)
    return enc.eval().requires_grad_(False)


# ---- the DiT (HunyuanDiT, diffusers' names; nodes/models/dit/dit.hpp) ----

# ---- the frozen VAE encoder (diffusers' AutoencoderKL encoder, names as nodes/models/vae/vae.hpp) ----

class VaeResnet(nn.Module):  # ResnetBlock2D without a time embedding
    def __init__(self, cin, cout, groups):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, cin, eps=1e-6), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(groups, cout, eps=1e-6), nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x):
        h = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class VaeAttention(nn.Module):  # the mid block's one-head attention over the H*W positions, residual
    def __init__(self, c, groups):
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, c, eps=1e-6)
        self.to_q, self.to_k, self.to_v = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)
        self.to_out = nn.ModuleList([nn.Linear(c, c)])

    def forward(self, x):
        B, C, H, W = x.shape
        h = self.group_norm(x).view(B, C, H * W).transpose(1, 2)
        q, k, v = self.to_q(h), self.to_k(h), self.to_v(h)
        a = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(C), dim=-1) @ v
        return x + self.to_out[0](a).transpose(1, 2).reshape(B, C, H, W)


class VaeDownsample(nn.Module):  # pad right and bottom by one, 3x3 stride 2
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class VaeDownBlock(nn.Module):  # DownEncoderBlock2D
    def __init__(self, cin, cout, layers, down, groups):
        super().__init__()
        self.resnets = nn.ModuleList([VaeResnet(cin if i == 0 else cout, cout, groups) for i in range(layers)])
        self.downsamplers = nn.ModuleList([VaeDownsample(cout)]) if down else None

    def forward(self, x):
        for r in self.resnets:
            x = r(x)
        return self.downsamplers[0](x) if self.downsamplers is not None else x


class VaeMidBlock(nn.Module):  # UNetMidBlock2D: resnet, attention, resnet
    def __init__(self, c, groups):
        super().__init__()
        self.attentions = nn.ModuleList([VaeAttention(c, groups)])
        self.resnets = nn.ModuleList([VaeResnet(c, c, groups), VaeResnet(c, c, groups)])

    def forward(self, x):
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class VaeEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        ch, g = c["block_out_channels"], c["norm_num_groups"]
        self.conv_in = nn.Conv2d(3, ch[0], 3, padding=1)
        self.down_blocks = nn.ModuleList([VaeDownBlock(ch[max(i - 1, 0)], ch[i], c["layers_per_block"], i + 1 < len(ch), g)
                                          for i in range(len(ch))])
        self.mid_block = VaeMidBlock(ch[-1], g)
        self.conv_norm_out = nn.GroupNorm(g, ch[-1], eps=1e-6)
        self.conv_out = nn.Conv2d(ch[-1], 2 * c["latent_channels"], 3, padding=1)

    def forward(self, x):
        x = self.conv_in(x)
        for b in self.down_blocks:
            x = b(x)
        return self.conv_out(F.silu(self.conv_norm_out(self.mid_block(x))))


class VaeEncode(nn.Module):
    """vae_encode: images -> (mean + exp(logvar / 2) * eps) * scaling_factor (logvar clamped)."""

    def __init__(self, c):
        super().__init__()
        self.encoder = VaeEncoder(c)
        self.quant_conv = nn.Conv2d(2 * c["latent_channels"], 2 * c["latent_channels"], 1)
        self.scaling = c["scaling_factor"]

    def forward(self, images):
        mean, logvar = self.quant_conv(self.encoder(images)).chunk(2, dim=1)
        return (mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * torch.randn_like(mean)) * self.scaling


def make_vae(c):
    return VaeEncode(c).eval().requires_grad_(False)


def ln(d, affine=True):
    return nn.LayerNorm(d, eps=1e-6, elementwise_affine=affine)


def rope_2d(head_dim, gh, gw):
    """(cos, sin) [gh*gw, head_dim]: first half of a head's channels rotated by the patch
    column, second half by the row, pairs (2k, 2k+1), f_k = 10000^(-2k/(head_dim/2))."""
    half = head_dim // 2
    freqs = 1.0 / 10000.0 ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
    rows = torch.arange(gh, dtype=torch.float32).repeat_interleave(gw)
    cols = torch.arange(gw, dtype=torch.float32).repeat(gh)
    a = torch.cat([torch.outer(cols, freqs).repeat_interleave(2, 1), torch.outer(rows, freqs).repeat_interleave(2, 1)], 1)
    return a.cos(), a.sin()


def apply_rope(x, cos, sin):
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    rot = torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)
    return x * cos + rot * sin


def timestep_features(t, dim=256):
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float32, device=t.device) * (-math.log(10000.0) / half))
    a = t.float()[:, None] * freqs[None]
    return torch.cat([a.cos(), a.sin()], 1)


class TwoLayer(nn.Module):  # linear_1 -> SiLU -> linear_2 (diffusers' TimestepEmbedding)
    def __init__(self, i, m, o):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(i, m), nn.Linear(m, o)

    def forward(self, x):
        return self.linear_2(F.silu(self.linear_1(x)))


class AdaNormShift(nn.Module):  # norm1: LN(x) + linear(SiLU(temb))
    def __init__(self, d):
        super().__init__()
        self.linear, self.norm = nn.Linear(d, d), ln(d)

    def forward(self, x, temb):
        return self.norm(x) + self.linear(F.silu(temb))[:, None]


class AdaNormContinuous(nn.Module):  # norm_out: LN(x, no affine) * (1 + scale) + shift
    def __init__(self, d):
        super().__init__()
        self.linear, self.norm = nn.Linear(d, 2 * d), ln(d, affine=False)

    def forward(self, x, temb):
        scale, shift = self.linear(F.silu(temb)).chunk(2, 1)
        return self.norm(x) * (1 + scale)[:, None] + shift[:, None]


class Attention(nn.Module):
    """qk-LayerNorm per head, 2-D RoPE on q (and on k for self-attention; the text keys of the
    cross-attention are not rotated); every key attended to (padded text tokens are learned
    embeddings, HunyuanDiT's text_embedding_padding)."""

    def __init__(self, d, kv_dim, heads, cross):
        super().__init__()
        self.h, self.cross = heads, cross
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(kv_dim, d), nn.Linear(kv_dim, d)
        self.norm_q, self.norm_k = ln(d // heads), ln(d // heads)
        self.to_out = nn.ModuleList([nn.Linear(d, d)])

    def forward(self, x, ctx, cos, sin, bias):
        B, N, D = x.shape
        kv = ctx if self.cross else x
        L, H = kv.size(1), self.h
        q = apply_rope(self.norm_q(self.to_q(x).view(B, N, H, D // H).transpose(1, 2)), cos, sin)
        k = self.norm_k(self.to_k(kv).view(B, L, H, D // H).transpose(1, 2))
        v = self.to_v(kv).view(B, L, H, D // H).transpose(1, 2)
        if not self.cross:
            k = apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.to_out[0](y.transpose(1, 2).reshape(B, N, D))


class GeluProj(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.proj = nn.Linear(i, o)

    def forward(self, x):
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, d, inner):
        super().__init__()
        self.net = nn.ModuleList([GeluProj(d, inner), nn.Identity(), nn.Linear(inner, d)])  # diffusers' ff.net.{0,2}

    def forward(self, x):
        return self.net[2](self.net[0](x))


class DitBlock(nn.Module):
    def __init__(self, c, skip):
        super().__init__()
        d = c["hidden"]
        self.norm1 = AdaNormShift(d)
        self.attn1 = Attention(d, d, c["heads"], cross=False)
        self.norm2 = ln(d)
        self.attn2 = Attention(d, c["text_dim"], c["heads"], cross=True)
        self.norm3 = ln(d)
        self.ff = FeedForward(d, int(d * c["mlp_ratio"]))
        self.has_skip = skip
        if skip:
            self.skip_norm, self.skip_linear = ln(2 * d), nn.Linear(2 * d, d)

    def forward(self, h, temb, ctx, ctx_bias, cos, sin, skip):
        if self.has_skip:
            h = self.skip_linear(self.skip_norm(torch.cat([h, skip], -1)))
        h = h + self.attn1(self.norm1(h, temb), None, cos, sin, None)
        h = h + self.attn2(self.norm2(h), ctx, cos, sin, ctx_bias)
        return h + self.ff(self.norm3(h))


class PatchEmbed(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.proj = nn.Conv2d(c["in_channels"], c["hidden"], c["patch"], stride=c["patch"])


class TimeEmbed(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.timestep_embedder = TwoLayer(256, d, d)


class Dit(nn.Module):
    """HunyuanDiT2DModel without T5, pooled-text and size/style conditioning (as flowrun's dit
    with t5_dim 0). Long skips: block i > depth/2 takes the output of block depth-1-i."""

    def __init__(self, c, cond_drop=0.0):
        super().__init__()
        self.c, self.cond_drop = c, cond_drop
        self.text_embedding_padding = nn.Parameter(torch.zeros(c["text_len"], c["text_dim"]))
        self.pos_embed = PatchEmbed(c)
        self.time_extra_emb = TimeEmbed(c["hidden"])
        self.blocks = nn.ModuleList(DitBlock(c, i > c["depth"] // 2) for i in range(c["depth"]))
        self.norm_out = AdaNormContinuous(c["hidden"])
        self.proj_out = nn.Linear(c["hidden"], c["patch"] ** 2 * c["in_channels"])
        self._rope = {}

    def rope(self, gh, gw, device):
        key = (gh, gw, str(device))
        if key not in self._rope:
            self._rope[key] = tuple(t.to(device) for t in rope_2d(self.c["hidden"] // self.c["heads"], gh, gw))
        return self._rope[key]

    def forward(self, x, t, text, text_mask):
        p, C = self.c["patch"], self.c["in_channels"]
        B, gh, gw = x.size(0), x.size(2) // p, x.size(3) // p
        if self.training and self.cond_drop > 0:  # classifier-free guidance: a row's text -> the null condition
            drop = torch.rand(B, device=x.device) < self.cond_drop
            text = torch.where(drop[:, None, None], torch.zeros_like(text), text)
            text_mask = torch.where(drop[:, None], torch.ones_like(text_mask), text_mask)
        text = torch.where(text_mask[:, :, None].bool(), text, self.text_embedding_padding)  # padded -> learned rows
        h = self.pos_embed.proj(x).flatten(2).transpose(1, 2)  # [B, N, hidden], row-major patches
        temb = self.time_extra_emb.timestep_embedder(timestep_features(t))
        cos, sin = self.rope(gh, gw, x.device)
        d, skips = self.c["depth"], []
        for i, blk in enumerate(self.blocks):
            h = blk(h, temb, text, None, cos, sin, skips.pop() if blk.has_skip else None)
            if i < d - 1 - d // 2:
                skips.append(h)
        h = self.proj_out(self.norm_out(h, temb))
        return h.reshape(B, gh, gw, p, p, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, gh * p, gw * p)


def make_dit(c, cond_drop):
    """flowrun's init rule (HunyuanDiT's initialize_weights): xavier-uniform weights (the patch
    conv as [out, in*p*p]), biases 0, timestep MLP N(0, 0.02), adaLN modulations and proj_out 0."""
    torch.manual_seed(1)
    model = Dit(c, cond_drop)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm1.linear." in name or "norm_out.linear." in name or name.startswith("proj_out.") or name.endswith(".bias"):
                p.zero_()
            elif "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            elif "timestep_embedder." in name:
                p.normal_(0.0, 0.02)
            elif name == "text_embedding_padding":
                p.normal_(0.0, 1.0)
            else:
                a = math.sqrt(6.0 / (p[0].numel() + p.size(0)))
                p.uniform_(-a, a)
    return model


def param_count(model):
    return sum(p.numel() for p in model.parameters())


# ---- the training step ----

def alphas_cumprod(cfg):
    """scaled_linear betas (SD / HunyuanDiT), float64 as flowrun keeps them."""
    betas = torch.linspace(cfg["beta_start"] ** 0.5, cfg["beta_end"] ** 0.5, cfg["timesteps"], dtype=torch.float64) ** 2
    return torch.cumprod(1.0 - betas, 0)


def diffusion_loss(model, x0, text, mask, ab):
    """t ~ U{0..T-1} per row, eps ~ N(0, I); the model predicts v = sqrt(ab) eps - sqrt(1-ab) x0
    from x_t = sqrt(ab) x0 + sqrt(1-ab) eps; MSE over all elements."""
    B = x0.size(0)
    t = torch.randint(0, ab.numel(), (B,), device=x0.device)
    noise = torch.randn_like(x0)
    a = ab[t].to(x0.dtype).view(B, 1, 1, 1)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
    v = a.sqrt() * noise - (1 - a).sqrt() * x0
    return F.mse_loss(model(xt, t, text, mask).float(), v.float())


def ema_decay(step, cfg):
    """Warm-up (HunyuanDiT, diffusers' EMAModel): 1 - (1 + n)^-power for the n-th update
    (n = step - 1: the first update copies the model), capped at the decay."""
    return min(cfg["ema_decay"], 1.0 - (1.0 + max(step - 1, 0)) ** -cfg["ema_power"])


@torch.no_grad()
def ema_update(ema_params, params, decay):
    torch._foreach_mul_(ema_params, decay)  # timm's ModelEmaV3 / diffusers' foreach EMA
    torch._foreach_add_(ema_params, params, alpha=1.0 - decay)


def timed_steps(cfg, model, ema, vae, encoder, opt, sched, batches, steps, warmup, window, device="cpu",
                bf16=False):
    """Trains `steps` steps; seconds per step, one per window of `window` steps after `warmup`.
    bf16: the forwards under bf16 autocast on `device`."""
    device = torch.device(device)
    ab = alphas_cumprod(cfg).to(device)
    params = [p for p in model.parameters()]
    ema_params = [p for p in ema.parameters()]
    amp = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, t0 = [], None
    for step in range(steps):
        if step == warmup:
            sync()  # the warm-up steps' queued work is not the first window's
            t0 = time.perf_counter()
        images, ids, mask = (x.to(device, non_blocking=True) for x in next(batches))
        with torch.no_grad():
            latents = vae(images)  # fp32, as bench/gpu_dit.py's flowrun runs its VAE (the graph's anchor shares its settings)
            with amp:
                text = encoder(ids, mask).float()  # fp32 out, as flowrun's bert_encode gives it
        with amp:
            loss = diffusion_loss(model, latents, text, mask, ab)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg["clip"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        ema_update(ema_params, params, ema_decay(step + 1, cfg))
        if step >= warmup and (step + 1 - warmup) % window == 0:
            loss.item()  # a trainer logs its loss: one host sync per window, as flowrun's metrics
            t1 = time.perf_counter()
            times.append((t1 - t0) / window)
            t0 = t1
    return times


def made_on(device):
    """Modules made (and initialized) directly on a GPU where torch can (torch.device as a context
    manager, torch >= 2.0): no CPU init and copy of a large model. On the CPU, nothing changes."""
    if device.type != "cpu" and hasattr(torch.device, "__enter__"):
        return device
    return contextlib.nullcontext()


def setup(cfg, data, workers=1, device="cpu"):
    """The loop's objects, made before the clock starts: (model, ema, vae, encoder, opt, sched, batches)."""
    device = torch.device(device)
    with made_on(device):
        model = make_dit(cfg["dit"], cfg["cond_drop"]).train().to(device)
        vae = make_vae(cfg["vae"]).to(device)
        encoder = make_encoder(cfg["bert"]).to(device)
    ema = copy.deepcopy(model).requires_grad_(False)
    kw = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"], **kw)
    warm = cfg["warmup"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warm) if warm else 1.0)  # step/warmup * lr
    loader = make_loader(cfg, data, workers=workers, pin=device.type == "cuda")
    return model, ema, vae, encoder, opt, sched, forever(loader)


def dit_round(cfg, data, steps, warmup, window, threads=None, workers=1, device="cpu", precision="fp32"):
    """Seconds per step of the loop: the median over windows after warm-up. precision: fp32 or
    bf16 (autocast)."""
    if threads:
        torch.set_num_threads(threads)
    model, ema, vae, encoder, opt, sched, batches = setup(cfg, data, workers, device)
    return statistics.median(timed_steps(cfg, model, ema, vae, encoder, opt, sched, batches, steps, warmup, window,
                                         device, precision == "bf16"))


# ---- flowrun ----

def dit_overrides(cfg, data, steps, window, threads=0, device="cpu", precision="fp32"):
    """graphs/dit_base.yaml as the loop: the same data, VAE encoder (seeded random in both: the
    work is the same without a trained one), model, objective, optimizer and EMA (every step);
    the sampler, evaluation and checkpoints, which the loop does not have, moved past the last
    step. device and precision: run.device and run.precision (bf16: the training forward under
    autocast; the frozen encoders keep their own `dtype`)."""
    b, d = cfg["bert"], cfg["dit"]
    return ["graphs/dit_base.yaml", "data.path=" + data, "data.batch=%d" % cfg["batch"], "data.size=%d" % cfg["size"],
            "tok.vocab=" + cfg["vocab_txt"], "tok.max_length=%d" % cfg["max_length"]] + \
           ["vae.weights=null"] + \
           ["vae.%s=%s" % kv for kv in sorted(cfg["vae"].items())] + \
           ["text.%s=%d" % kv for kv in sorted(b.items())] + \
           ["model.%s=%s" % kv for kv in sorted(d.items())] + \
           ["loss.cond_drop=%g" % cfg["cond_drop"], "opt.lr=%g" % cfg["lr"], "opt.warmup=%d" % cfg["warmup"],
            "opt.weight_decay=%g" % cfg["weight_decay"], "opt.clip=%g" % cfg["clip"], "ema.decay=%g" % cfg["ema_decay"],
            "run.steps=%d" % steps, "run.log_every=%d" % window, "run.device=" + device, "run.precision=" + precision,
            "run.threads=%d" % threads,
            "sample.every=1000000", "sample.at=[]", "fid.every=1000000", "fid.at=[]", "eval.every=1000000", "eval.at=[]", "evlog.every=1000000",
            "evlog.at=[]", "ckpt.every=1000000", "ckpt.at=[]"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/shapes/base")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast of the forwards")
    args = ap.parse_args()
    cfg = DIT_DEMO
    print("DiT parameters: %d (frozen BERT: %d, frozen VAE encoder: %d)" % (
        param_count(make_dit(cfg["dit"], 0.0)), param_count(make_encoder(cfg["bert"])),
        param_count(make_vae(cfg["vae"]))), flush=True)
    s = dit_round(cfg, args.data, args.steps, args.warmup, args.window, args.threads, args.workers, args.device,
                  args.precision)
    print("%.3f s/step, %.2f steps/s, %.1f images/s" % (s, 1 / s, cfg["batch"] / s))


if __name__ == "__main__":
    main()
