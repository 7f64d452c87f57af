#!/usr/bin/env python3
"""The layers, checked: no source file includes a header of a layer above its own (ctest
layers.includes). Bottom up, a folder per layer (a layer may include its own and any below):

  0  engine/                  graph files, schemas, executor; no torch
  0  nodes/formats/           file formats and tokenizers; no torch, no engine
  1  nodes/common/ parallel/  safetensors, devices, flat buffers, state I/O, seeds, batch keys; the
                              parallel mesh and the one collective interface (MPI, NCCL)
  2  nodes/data/ comm/ models/  data nodes, the job's start-up agreement, libtorch modules
  3  nodes/train/ state/      objectives, forward/backward, optimizer, EMA, checkpoints
  4  nodes/encode/            frozen encoders and tokenizer nodes
  5  nodes/eval/              evaluators, sampler, metrics
  6  nodes/prep/              the `flowrun prep` tool
  7  session/                 a run of a checked graph
  8  cli/                     the flowrun command

  python3 tests/tools/include_layers.py [SRC]    (exit 1 and one line per include against the order)
"""
import os
import re
import sys

LAYERS = {"engine": 0, "formats": 0, "common": 1, "parallel": 1, "data": 2, "comm": 2, "models": 2, "train": 3, "state": 3,
          "encode": 4, "eval": 5, "prep": 6, "session": 7, "cli": 8}


def layer_of_file(rel):
    if rel.startswith("cli/"):
        return "cli"
    if rel.startswith("engine/"):
        return "engine"
    if rel.startswith("session/"):
        return "session"
    m = re.match(r"nodes/([a-z_]+)/", rel)
    return m.group(1) if m else None


def main():
    src = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
    engine_headers = set(os.listdir(os.path.join(src, "engine")))
    session_headers = set(os.listdir(os.path.join(src, "session")))
    bad, files = [], 0
    for top in ("engine", "nodes", "session", "cli"):
        for root, _, names in os.walk(os.path.join(src, top)):
            for name in names:
                if not name.endswith((".cpp", ".hpp", ".cu", ".cuh")):
                    continue
                path = os.path.join(root, name)
                rel = os.path.relpath(path, src)
                mine = layer_of_file(rel)
                if mine not in LAYERS:
                    raise SystemExit("%s: in no layer; add its folder to LAYERS in %s" % (rel, __file__))
                files += 1
                with open(path, encoding="utf-8") as f:
                    for line_no, line in enumerate(f, 1):
                        m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
                        if not m:
                            continue
                        inc = m.group(1)
                        if "/" in inc:
                            theirs = inc.split("/")[0]
                        elif inc in session_headers:
                            theirs = "session"
                        elif inc in engine_headers:
                            theirs = "engine"
                        else:
                            continue  # a file beside it (spm_shim's own headers)
                        if theirs not in LAYERS:
                            continue  # generated or third-party
                        where = "%s:%d: includes %s: " % (rel, line_no, inc)
                        if mine == "formats" and theirs == "engine":
                            bad.append(where + "flowrun_formats (nodes/formats/) does not link the engine; pass what it "
                                       "needs as arguments")
                        elif LAYERS[theirs] > LAYERS[mine]:
                            bad.append(where + "layer %s (%d) is above %s (%d); move the code down, or make it an "
                                       "interface below that the upper layer implements" %
                                       (theirs, LAYERS[theirs], mine, LAYERS[mine]))
    for b in bad:
        print(b)
    print("%d files, %d includes against the layer order (tests/tools/include_layers.py lists the layers)" %
          (files, len(bad)))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
