#!/usr/bin/env python3
"""What flowrun saves back, loaded by transformers itself: graphs/llama.yaml reads each llama-family
fixture folder (tests/fixtures/hf: Llama 3.1, Llama 3.2 tied, Qwen 2.5) by `model.pretrained`,
trains one step at learning rate 0 (the weights stay the fixture's) and checkpoints with
`ckpt.exports=true`, the llama31 one in shards of 40 KB; then transformers' AutoModelForCausalLM
loads each checkpoint folder (no missing or unexpected tensor) and its logits for the fixture's
tokens equal the reference transformers gave for the fixture within 1e-6.

Needs transformers (the fixtures' pinned 5.17.0 in .cache/hf-transformers, as
tests/fixtures/hf/requirements.txt installs it) and scripts/data.sh's byte shards: exit 77
(skipped) without them.

  python3 tests/cli/hf_export_check.py BUILD_DIR
"""
import json
import os
import subprocess
import sys
import tempfile

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    build = os.path.abspath(sys.argv[1])
    sys.path.insert(0, os.path.join(SRC, ".cache", "hf-transformers"))
    try:
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        print("skipped: %s (install the fixtures' transformers: tests/fixtures/hf/requirements.txt)" % e)
        sys.exit(77)
    if not os.path.exists(os.path.join(SRC, "data/text/fortunes_byte.train.bin")):
        print("skipped: no data/text/fortunes_byte (scripts/data.sh)")
        sys.exit(77)
    flowrun = os.path.join(build, "engine", "flowrun")
    ref = load_file(os.path.join(SRC, "tests/fixtures/hf/reference_llama.safetensors"))
    failed = []
    with tempfile.TemporaryDirectory(prefix="flowrun-hf-export-") as tmp:
        for name, more in [("llama31", ["model.export_shard_mb=0.04"]), ("llama32", []), ("qwen25", [])]:
            out = os.path.join(tmp, name)
            # The sizes graphs/llama.yaml writes, as the folder has them (written ones must agree).
            with open(os.path.join(SRC, "tests/fixtures/hf", name, "config.json")) as f:
                c = json.load(f)
            sizes = {"layers": "num_hidden_layers", "dim": "hidden_size", "heads": "num_attention_heads",
                     "kv_heads": "num_key_value_heads", "mlp_dim": "intermediate_size", "vocab": "vocab_size",
                     "context": "max_position_embeddings"}
            cmd = [flowrun, "graphs/llama.yaml", "data.path=data/text/fortunes_byte", "data.seq_len=16", "data.batch=2",
                   "model.pretrained=tests/fixtures/hf/" + name, "opt.lr=0", "opt.min_lr=0", "run.steps=1",
                   "eval.every=1000", "evlog.every=1000", "ckpt.every=1", "ckpt.exports=true", "run.progress=off",
                   "run.out_dir=" + out] + ["model.%s=%d" % (k, c[v]) for k, v in sizes.items()] + more
            p = subprocess.run(cmd, cwd=SRC, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if p.returncode != 0:
                failed.append("%s: flowrun exited %d:\n%s" % (name, p.returncode, p.stdout[-3000:]))
                continue
            folder = os.path.join(out, "checkpoints", "step_00000001")
            model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True,
                                                               attn_implementation="eager")
            model = model.float().eval()
            for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
                if info.get(kind):
                    failed.append("%s: from_pretrained reports %s %s" % (name, kind, sorted(info[kind])))
            tokens = ref[name + ".tokens"].long()
            with torch.no_grad():
                logits = model(input_ids=tokens[:, :-1]).logits.float()
            want = ref[name + ".logits"]
            r = ((logits - want).norm() / want.norm()).item()
            shards = sorted(f for f in os.listdir(folder) if f.startswith("model-"))
            print("%s: %s from %s (%s), logits differ from the reference by %.2e relative"
                  % (name, type(model).__name__, folder, "%d shards" % len(shards) if shards else "one file", r))
            if r > 1e-6:
                failed.append("%s: logits differ by %.2e relative" % (name, r))
            if name == "llama31" and len(shards) < 2:
                failed.append("llama31: expected several shards, got %s" % shards)
    for f in failed:
        print("FAILED: " + f)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
