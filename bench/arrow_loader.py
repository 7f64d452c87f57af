#!/usr/bin/env python3
"""HunyuanDiT's data path against flowrun's on the same Arrow files: images per second.

Both sides read the same csv2arrow-layout Arrow files (made by `flowrun prep arrow` from JPEG
photos-like images of HunyuanDiT's sizes) through an Index V2, and produce float batches of
3 x SIZE x SIZE in [-1, 1]:
  - peer: what HunyuanDiT's trainer runs per sample — IndexKits' own ArrowIndexV2.get_image
    (pyarrow, PIL decode, convert RGB) and its resize_and_crop (PIL LANCZOS, random crop), then
    ToTensor + Normalize([0.5], [0.5]) (as numpy), in a torch DataLoader with --workers worker
    processes (the trainer's default layout);
  - flowrun: the image_text_shards node on the index (decode, area resize, centre crop, in
    parallel on the process's threads), `flowrun` on a graph of the node alone.
Rounds alternate; each side's time excludes its start-up (flowrun: the steps' time it reports;
peer: from its first batch on). Medians and each round's figure are printed.

  .venv/bin/python bench/arrow_loader.py --hunyuandit /tmp/hydit [--images 256] [--size 512] [--rounds 3]

--hunyuandit: a folder holding HunyuanDiT's IndexKits/ (github Tencent/HunyuanDiT; `git archive
368280e IndexKits | tar -x -C DIR`). Needs numpy, pillow, pyarrow, torch (requirements.txt).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [(1024, 768), (768, 1024), (1024, 1024), (1280, 720), (720, 1280)]  # width, height


def make_images(folder, n):
    rng = np.random.default_rng(1)
    os.makedirs(folder, exist_ok=True)
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        # Smooth gradients plus noise: JPEG sizes like photos' (~150-250 KB at q90), not flat colour.
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        base = np.stack([x / w * 255, y / h * 255, (x + y) / (w + h) * 255], -1)
        img = np.clip(base + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)
        with open(os.path.join(folder, f"{i:05d}.txt"), "w") as f:
            f.write(f"一张测试图片 {i}")


def peer_round(index, size, batch, workers, batches, hunyuandit):
    sys.path.insert(0, hunyuandit)
    import torch
    from IndexKits.index_kits import ArrowIndexV2

    class Stream(torch.utils.data.Dataset):  # the per-sample work of TextImageArrowStream, multireso path
        def __init__(self):
            self.idx = ArrowIndexV2(index)

        def __len__(self):
            return len(self.idx)

        def __getitem__(self, i):
            img = self.idx.get_image(i)
            img, _ = self.idx.resize_and_crop(img, (size, size), resample=Image.LANCZOS, crop_type="random")
            a = np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0
            return torch.from_numpy((a - 0.5) / 0.5), self.idx.get_attribute(i, "text_zh")

    loader = torch.utils.data.DataLoader(Stream(), batch_size=batch, shuffle=True, num_workers=workers, drop_last=True,
                                         persistent_workers=False)
    it = iter(loader)
    next(it)  # start-up: workers and the first batch
    t0 = time.perf_counter()
    for _ in range(batches):
        try:
            next(it)
        except StopIteration:
            it = iter(loader)
            next(it)
    return batches * batch / (time.perf_counter() - t0)


def flowrun_round(flowrun, index, size, batch, batches, work):
    graph = os.path.join(work, "g.yaml")
    with open(graph, "w") as f:
        f.write(f"flowrun: 1\nrun: {{ steps: {batches + 1}, seed: 1, prefetch: 2, log_every: 1000000, out_dir: {work}/run }}\n"
                f"nodes:\n  data: {{ type: image_text_shards, with: {{ path: '{index}', size: {size}, batch: {batch} }} }}\n"
                f"  log: {{ type: metrics, in: {{ skipped: data.skipped }} }}\n")
    p = subprocess.run([flowrun, graph, "run.resume=never"], capture_output=True, text=True, check=True)
    m = re.search(r"done: (\d+) steps in ([0-9.]+) s", p.stdout + p.stderr)
    steps, seconds = int(m.group(1)), float(m.group(2))
    return steps * batch / seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hunyuandit", required=True)
    ap.add_argument("--flowrun", default=os.path.join(ROOT, "build/engine/flowrun"))
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="arrow-bench-")
    make_images(os.path.join(work, "src"), a.images)
    subprocess.run([a.flowrun, "prep", "arrow", os.path.join(work, "src"), os.path.join(work, "data")], check=True,
                   stdout=subprocess.DEVNULL)
    index = os.path.join(work, "data", "index.json")
    mb = sum(os.path.getsize(os.path.join(work, "data", "arrows", f)) for f in os.listdir(os.path.join(work, "data", "arrows"))) / 2**20
    print(f"{a.images} JPEGs ({mb:.0f} MB of Arrow files), {a.size}x{a.size}, batch {a.batch}, {a.batches} batches a round, "
          f"peer with {a.workers} DataLoader workers, {os.cpu_count()} cores")
    ours, peer = [], []
    for r in range(a.rounds):
        ours.append(flowrun_round(a.flowrun, index, a.size, a.batch, a.batches, work))
        peer.append(peer_round(index, a.size, a.batch, a.workers, a.batches, a.hunyuandit))
        print(f"round {r + 1}: flowrun {ours[-1]:.1f} images/s, HunyuanDiT's loader {peer[-1]:.1f} images/s, ratio {ours[-1] / peer[-1]:.2f}")
    print(f"median: flowrun {statistics.median(ours):.1f} images/s, HunyuanDiT's loader {statistics.median(peer):.1f} images/s, "
          f"ratio {statistics.median(o / p for o, p in zip(ours, peer)):.2f} (rounds {', '.join(f'{o / p:.2f}' for o, p in zip(ours, peer))})")


if __name__ == "__main__":
    main()
