#!/usr/bin/env python3
"""Every command README.md shows, run as a new user would type it (ctest cli.readme_commands).

A recipe goes stale when the graph it names changes (a checkpoint folder that keep_last now
deletes, a step count the base has already passed, a config that another run's checkpoints
refuse). So this test reads the README itself, takes every command of its ```sh blocks (but
the first block's scripts/setup.sh and scripts/test.sh, which CI runs) in order, and runs each
as written in a sandbox folder laid out like the repository (graphs/, data/, examples/, tests/ and
build/ linked in, runs/ empty), after what scripts/setup.sh's demo runs before a user reaches
them (the VAE, the base DiT and the LoRA demo, with the same run.resume settings).

Only the size is changed: `build/engine/flowrun` in the sandbox is a wrapper that appends
TINY[graph] to every run of a graph file, small widths and batches (never run.steps,
run.resume, run.out_dir or a weights path, which are what goes stale), so the whole README
runs in a few minutes on 2 cores. A command fails the test when it exits non-zero or says
"nothing to do" (a continuation that continues nothing).

  python3 tests/cli/readme_commands.py BUILD_DIR [--keep]     (from anywhere; SRC is this repo)
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Small sizes per graph file, appended to the README's own overrides (the last one wins).
VAE_TINY = ["block_out_channels=[8, 8, 8]", "norm_num_groups=4"]
DIT_TINY = (["data.batch=4", "tok.max_length=12", "text.dim=16", "text.heads=2", "text.ffn=32",
             "model.hidden=32", "model.depth=2", "model.heads=2", "model.mlp_ratio=2.0", "model.text_dim=16",
             "sample.steps=3", "sample.per_prompt=1", "sample.zoom=1", "eval.batch=8", "eval.batches=1"] +
            ["vae." + o for o in VAE_TINY])
TINY = {
    "graphs/regression.yaml": [],
    # 16x16 images (the VAE's steps cost 43 s at 32x32, 28 s at 16, when it ran all 2500); the
    # DiT graphs still encode their 32x32 images with it (a conv VAE takes any size).
    "graphs/vae.yaml": ["data.batch=4", "data.size=16", "recon.batch=8", "recon.batches=1", "recon.zoom=1"] +
                       ["model." + o for o in VAE_TINY],
    "graphs/dit_base.yaml": DIT_TINY,
    "graphs/hydit_lora.yaml": DIT_TINY + ["prior.batch=2"],
    "graphs/gpt.yaml": ["model.layers=1", "model.dim=32", "model.heads=2", "data.batch=4", "data.seq_len=32",
                        "model.context=32", "eval.batches=2", "eval.batch=4"],
    "graphs/cappa.yaml": ["data.size=16", "model.image_size=16", "model.patch=8", "model.width=16", "model.depth=1",
                          "model.heads=2", "model.mlp_dim=32", "model.dec_width=16", "model.dec_depth=1",
                          "model.dec_heads=2", "model.dec_mlp_dim=32", "data.batch=4", "eval.batch=8",
                          "eval.batches=1"],
}

# What scripts/setup.sh runs before a user reads on (its demo), in its order and with its settings,
# but for the VAE's length: no README command continues the VAE (the DiT graphs read its latest
# checkpoint), so here it trains 500 of its 2500 steps (62 s of this test's 160 at 2500).
SETUP_DEMO = ["build/engine/flowrun graphs/vae.yaml run.resume=auto run.steps=500",
              "build/engine/flowrun graphs/dit_base.yaml run.resume=auto",
              "build/engine/flowrun graphs/hydit_lora.yaml run.resume=never"]

WRAPPER = r'''#!/usr/bin/env python3
# The sandbox's flowrun: the real one, with the tiny sizes of the graph it runs appended.
import os, sys
TINY = %(tiny)r
args = sys.argv[1:]
graph = args[1] if len(args) > 1 and args[0] == "run" else (args[0] if args else "")
os.execv(%(real)r, [%(real)r] + args + TINY.get(graph, []))
'''


def readme_commands():
    text = open(os.path.join(SRC, "README.md")).read()
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)  # continuation lines
        for line in joined.splitlines():
            hash_at, quoted = None, None
            for i, c in enumerate(line):  # the comment: the first '#' after a blank, outside quotes
                if quoted:
                    quoted = None if c == quoted else quoted
                elif c in "'\"":
                    quoted = c
                elif c == "#" and (i == 0 or line[i - 1].isspace()):
                    hash_at = i
                    break
            command = (line if hash_at is None else line[:hash_at]).strip()
            if not command or command.startswith("scripts/"):
                continue  # setup.sh and test.sh: what CI itself runs
            commands.append(command)
    return commands


def sandbox(build, root):
    for d in ("graphs", "data", "examples", "schemas", "tests"):  # tests/: the fixture folders graphs read (llama_lora)
        os.symlink(os.path.join(SRC, d), os.path.join(root, d))
    os.makedirs(os.path.join(root, "build", "engine"))
    os.makedirs(os.path.join(root, "runs"))
    for d in os.listdir(build):  # plugins, libraries: build/examples/... as the graphs name them
        if d != "engine":
            os.symlink(os.path.join(build, d), os.path.join(root, "build", d))
    wrapper = os.path.join(root, "build", "engine", "flowrun")
    with open(wrapper, "w") as f:
        f.write(WRAPPER % {"tiny": TINY, "real": os.path.join(build, "engine", "flowrun")})
    os.chmod(wrapper, 0o755)


def run(command, root, log):
    env = dict(os.environ, OMPI_MCA_btl_vader_single_copy_mechanism="none")
    shell = command
    if re.match(r"mpirun\b", shell):  # as the README says for root, and on a 2-core machine
        extra = "--oversubscribe --bind-to none" + (" --allow-run-as-root" if os.geteuid() == 0 else "")
        shell = shell.replace("mpirun", "mpirun " + extra, 1)
    t0 = time.time()
    p = subprocess.run(["bash", "-c", "B=build/engine/flowrun\n" + shell], cwd=root, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    log.write("$ %s\n%s\n(exit %d, %.1f s)\n\n" % (command, p.stdout, p.returncode, time.time() - t0))
    log.flush()
    problem = None
    if p.returncode != 0:
        problem = "exit %d" % p.returncode
    elif "nothing to do" in p.stdout:
        problem = "it had nothing to do (a stale step count?)"
    print("%-6s %5.1f s  %s" % ("ok" if not problem else "FAIL", time.time() - t0, command), flush=True)
    if problem:
        print("  " + problem + "; its output:\n" + "\n".join("  | " + l for l in p.stdout.splitlines()[-25:]),
              flush=True)
    return problem is None


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    build = os.path.abspath(sys.argv[1])
    if not os.path.exists(os.path.join(SRC, "data", "shapes", "vocab.txt")):
        print("SKIP: data/ is missing: run scripts/data.sh first (scripts/setup.sh does)")
        sys.exit(77)
    commands = [c for c in readme_commands() if not c.startswith("B=")]
    if len(commands) < 10:
        sys.exit("README.md: found only %d commands in its sh blocks; did the format change?" % len(commands))
    root = tempfile.mkdtemp(prefix="flowrun-readme-")
    ok = True
    try:
        sandbox(build, root)
        with open(os.path.join(root, "commands.log"), "w") as log:
            for c in SETUP_DEMO + commands:
                ok = run(c, root, log) and ok
        print("log: %s" % os.path.join(root, "commands.log"))
    finally:
        if "--keep" not in sys.argv and ok:
            shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
