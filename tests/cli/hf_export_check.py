#!/usr/bin/env python3
"""What flowrun saves back, loaded by transformers itself: graphs/llama.yaml reads each llama-family
fixture folder (tests/fixtures/hf: Llama 3.1, Llama 3.2 tied, Qwen 2.5, Qwen 3, and the mixtures of
experts Qwen 3 MoE and Mixtral, written back one expert at a time) by `model.pretrained`,
trains one step at learning rate 0 (the weights stay the fixture's) and checkpoints with
`ckpt.exports=true`, the llama31 one in shards of 40 KB; then transformers' AutoModelForCausalLM
loads each checkpoint folder (no missing or unexpected tensor) and its logits for the fixture's
tokens equal the reference transformers gave for the fixture within 1e-6.
And a LoRA fine-tune: graphs/llama_lora.yaml as written (its folder is llama31; adapters of rank 4
here on all seven projections) trains 5 steps at learning rate 1e-2 and exports its adapters (PEFT's layout);
peft's PeftModel.from_pretrained puts them on transformers' model of the same folder, and its
logits equal flowrun's for the model with those adapters (testtool model-logits, the adapters
read back by `model.adapters`) within 1e-5, and differ from the base's (the adapters trained).
And GPT-2: graphs/gpt.yaml reading the gpt2 fixture by `model.pretrained` saves it back as a folder
(testtool model-export: what the checkpoint's `exports` writes) that GPT2LMHeadModel loads with the
fixture's reference logits within 1e-6.

Needs transformers and peft (the fixtures' pinned transformers 5.17.0 in .cache/hf-transformers,
peft 0.18.0 with accelerate in .cache/hf-peft, as tests/fixtures/hf/requirements.txt installs
them) and scripts/data.sh's byte shards: exit 77 (skipped) without them.

  python3 tests/cli/hf_export_check.py BUILD_DIR
"""
import json
import os
import subprocess
import sys
import tempfile

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sizes_of(name):
    """The sizes graphs/llama.yaml writes, as fixture `name`'s config.json has them (written ones
    must agree with a pretrained folder)."""
    with open(os.path.join(SRC, "tests/fixtures/hf", name, "config.json")) as f:
        c = json.load(f)
    keys = {"layers": "num_hidden_layers", "dim": "hidden_size", "heads": "num_attention_heads",
            "kv_heads": "num_key_value_heads", "mlp_dim": "intermediate_size", "vocab": "vocab_size",
            "context": "max_position_embeddings"}
    return ["model.%s=%d" % (k, c[v]) for k, v in keys.items()]


def lora_check(flowrun, build, tmp, ref, torch, PeftModel, AutoModelForCausalLM, save_file, load_file):
    failed = []
    fixture = "tests/fixtures/hf/llama31"
    # graphs/llama_lora.yaml as written (its folder is this fixture), its adapters rank 4.
    common = ["graphs/llama_lora.yaml", "data.seq_len=16", "data.batch=4", "model.pretrained=" + fixture,
              "model.lora.rank=4", "model.lora.alpha=8"]
    out = os.path.join(tmp, "lora")
    cmd = [flowrun] + common + ["opt.lr=1e-2",
        "opt.warmup=0", "opt.schedule=constant", "run.steps=5", "eval.every=1000", "evlog.every=1000",
        "ckpt.every=5", "ckpt.exports=true", "run.progress=off", "run.out_dir=" + out]
    p = subprocess.run(cmd, cwd=SRC, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        return ["LoRA: flowrun exited %d:\n%s" % (p.returncode, p.stdout[-3000:])]
    adapters = os.path.join(out, "checkpoints", "step_00000005")
    tokens = ref["llama31.tokens"].long()
    save_file({"tokens": tokens}, os.path.join(tmp, "tokens.safetensors"))
    mine = os.path.join(tmp, "flowrun_logits.safetensors")
    p = subprocess.run([os.path.join(build, "tests", "mpi", "testtool"), "model-logits", common[0],
                        os.path.join(tmp, "tokens.safetensors"), mine] + common[1:] +
                       ["model.adapters=" + adapters, "run.out_dir=" + os.path.join(tmp, "logits_run")],
                       cwd=SRC, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        return ["LoRA: testtool model-logits exited %d:\n%s" % (p.returncode, p.stdout[-3000:])]
    flowrun_logits = load_file(mine)["logits"]
    base = AutoModelForCausalLM.from_pretrained(os.path.join(SRC, fixture), attn_implementation="eager").float().eval()
    with torch.no_grad():
        base_logits = base(input_ids=tokens[:, :-1]).logits.float()
    model = PeftModel.from_pretrained(base, adapters).eval()
    with torch.no_grad():
        peft_logits = model(input_ids=tokens[:, :-1]).logits.float()
    r = ((flowrun_logits - peft_logits).norm() / peft_logits.norm()).item()
    moved = ((peft_logits - base_logits).norm() / base_logits.norm()).item()
    print("LoRA: peft %s on %s: logits differ from flowrun's by %.2e relative; the adapters moved them %.2e from "
          "the base's" % (type(model).__name__, adapters, r, moved))
    if r > 1e-5:
        failed.append("LoRA: peft's logits differ from flowrun's by %.2e relative" % r)
    if moved < 1e-4:
        failed.append("LoRA: the adapters barely changed the logits (%.2e): the check would not see a wrong layout" % moved)
    return failed


def gpt_check(build, tmp, torch, AutoModelForCausalLM, load_file):
    """graphs/gpt.yaml reading the gpt2 fixture by `model.pretrained` saves it back (what a
    checkpoint's `exports` writes, here by testtool model-export, in shards of 4 KB):
    transformers' GPT2LMHeadModel loads the folder and gives the fixture's reference logits."""
    folder = os.path.join(tmp, "gpt2")
    p = subprocess.run([os.path.join(build, "tests", "mpi", "testtool"), "model-export", "graphs/gpt.yaml", folder,
                        "model.pretrained=tests/fixtures/hf/gpt2", "model.layers=2", "model.dim=16", "model.heads=2",
                        "model.vocab=80", "model.context=32", "model.export_shard_mb=0.004", "data.seq_len=16",
                        "run.out_dir=" + os.path.join(tmp, "gpt2_run")],
                       cwd=SRC, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        return ["gpt2: testtool model-export exited %d:\n%s" % (p.returncode, p.stdout[-3000:])]
    failed = []
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, attn_implementation="eager")
    model = model.float().eval()
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(kind):
            failed.append("gpt2: from_pretrained reports %s %s" % (kind, sorted(info[kind])))
    ref = load_file(os.path.join(SRC, "tests/fixtures/hf/reference_transformers.safetensors"))
    with torch.no_grad():
        logits = model(input_ids=ref["gpt2.input_ids"].long()).logits.float()
    want = ref["gpt2.logits"]
    r = ((logits - want).norm() / want.norm()).item()
    shards = sorted(f for f in os.listdir(folder) if f.startswith("model-"))
    print("gpt2: %s from %s (%d shards), logits differ from the reference by %.2e relative"
          % (type(model).__name__, folder, len(shards), r))
    if r > 1e-6:
        failed.append("gpt2: logits differ by %.2e relative" % r)
    if len(shards) < 2:
        failed.append("gpt2: expected several shards, got %s" % shards)
    return failed


def main():
    build = os.path.abspath(sys.argv[1])
    sys.path.insert(0, os.path.join(SRC, ".cache", "hf-transformers"))
    sys.path.insert(1, os.path.join(SRC, ".cache", "hf-peft"))
    try:
        import torch
        from peft import PeftModel
        from safetensors.torch import load_file, save_file
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        print("skipped: %s (install the fixtures' transformers and peft: tests/fixtures/hf/requirements.txt)" % e)
        sys.exit(77)
    if not os.path.exists(os.path.join(SRC, "data/text/fortunes_byte.train.bin")):
        print("skipped: no data/text/fortunes_byte (scripts/data.sh)")
        sys.exit(77)
    flowrun = os.path.join(build, "engine", "flowrun")
    ref = load_file(os.path.join(SRC, "tests/fixtures/hf/reference_llama.safetensors"))
    ref.update(load_file(os.path.join(SRC, "tests/fixtures/hf/reference_moe.safetensors")))
    failed = []
    with tempfile.TemporaryDirectory(prefix="flowrun-hf-export-") as tmp:
        for name, more in [("llama31", ["model.export_shard_mb=0.04"]), ("llama32", []), ("qwen25", []), ("qwen3", []),
                           ("qwen3moe", []), ("mixtral", [])]:
            out = os.path.join(tmp, name)
            cmd = [flowrun, "graphs/llama.yaml", "data.path=data/text/fortunes_byte", "data.seq_len=16", "data.batch=2",
                   "model.pretrained=tests/fixtures/hf/" + name, "opt.lr=0", "opt.min_lr=0", "run.steps=1",
                   "eval.every=1000", "evlog.every=1000", "ckpt.every=1", "ckpt.exports=true", "run.progress=off",
                   "run.out_dir=" + out] + sizes_of(name) + more
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
            if name in ("qwen3moe", "mixtral"):  # the experts one by one, as the Hub's files (and save_pretrained)
                from safetensors import safe_open
                names = set()
                for f in os.listdir(folder):
                    if f.endswith(".safetensors"):
                        with safe_open(os.path.join(folder, f), "pt") as st:
                            names.update(st.keys())
                one = "model.layers.0.%s.experts.1.%s.weight" % (("mlp", "up_proj") if name == "qwen3moe" else ("block_sparse_moe", "w3"))
                if one not in names:
                    failed.append("%s: the export has no %s (experts not written one by one)" % (name, one))
            print("%s: %s from %s (%s), logits differ from the reference by %.2e relative"
                  % (name, type(model).__name__, folder, "%d shards" % len(shards) if shards else "one file", r))
            if r > 1e-6:
                failed.append("%s: logits differ by %.2e relative" % (name, r))
            if name == "llama31" and len(shards) < 2:
                failed.append("llama31: expected several shards, got %s" % shards)
        failed += gpt_check(build, tmp, torch, AutoModelForCausalLM, load_file)
        failed += lora_check(flowrun, build, tmp, ref, torch, PeftModel, AutoModelForCausalLM, save_file, load_file)
    for f in failed:
        print("FAILED: " + f)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
