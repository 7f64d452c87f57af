#!/usr/bin/python3
"""Writes the fuzzers' seed corpora (tests/fuzz/corpus/NAME/): small valid and near-valid
inputs of each format, deterministic. Run from anywhere; rewrites only the seed-* files
(inputs kept from crashes, crash-*, stay)."""
import io, json, os, struct, tarfile, zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def put(name, fname, data):
    d = os.path.join(HERE, "corpus", name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, fname), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# graph: real graph files and a few near misses
for g in ["gpt.yaml", "regression.yaml", "hydit_lora.yaml"]:
    with open(os.path.join(ROOT, "graphs", g), "rb") as f:
        put("graph", "seed-" + g, f.read())
put("graph", "seed-anchors.yaml", "run: &r {steps: 5, seed: 1}\nnodes:\n  a: {type: synthetic_regression, with: {batch: 4}}\n  b: *r\n")
put("graph", "seed-subst.yaml", "run: {steps: ${STEPS:-3}, out_dir: runs/${run.name}}\nnodes: {}\n")
put("graph", "seed-subst-nested.yaml",
    "run: {out_dir: \"${OUT:-${run.trace}}/x\", trace: \"${TRACE:-t}.json\"}\nnodes: {}\n")

# overrides: KEY=VALUE lines for graphs/gpt.yaml
put("overrides", "seed-basic", "run.steps=5\nrun.seed=7\n")
put("overrides", "seed-params", "model.with.layers=2\nmodel.with.dim=32\nopt.with.lr=0.001\n")
put("overrides", "seed-flow", "run.resume=never\nckpt.at=[end, stop]\nckpt.every=2\n")
put("overrides", "seed-bad", "run.stesp=5\nnodes.x.type=nope\nmodel.with={\n")


def safetensors(tensors, metadata=None, pad=0):
    header, data, off = {}, b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * ((8 - (8 + len(h)) % 8) % 8 + pad)
    return struct.pack("<Q", len(h)) + h + data


put("safetensors", "seed-two", safetensors({"w": ("F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4)),
                                            "b": ("BF16", [2], b"\x80\x3f\x00\x40")}, {"format": "pt"}))
put("safetensors", "seed-empty", safetensors({}))
put("safetensors", "seed-scalar-zero", safetensors({"s": ("I64", [], struct.pack("<q", 5)), "z": ("F16", [0, 3], b"")}))
# Found while writing the header checks: 2^61 x 8 bytes wrapped around to 0 (issue 13).
put("safetensors", "crash-shape-overflow",
    safetensors({"w": ("F64", [2305843009213693952, 8], b"")}))

# idx: Megatron MMIDIDX version 1 (nodes/formats/indexed_dataset.hpp); the fuzzer's .bin is 4096 bytes
def idx(dtype_code, sizes, item):
    ptrs, p = [], 0
    for s in sizes:
        ptrs.append(p)
        p += s * item
    doc = list(range(len(sizes) + 1))
    return (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code) +
            struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc)) +
            struct.pack("<%di" % len(sizes), *sizes) + struct.pack("<%dq" % len(ptrs), *ptrs) +
            struct.pack("<%dq" % len(doc), *doc))


put("idx", "seed-uint16", idx(8, [3, 5, 1], 2))
put("idx", "seed-int32", idx(4, [10, 0, 7], 4))
put("idx", "seed-float32", idx(7, [2], 4))
put("idx", "seed-empty", idx(8, [], 2))


# tar: WebDataset-style members, a long name (ustar prefix), a GNU long name, a pax path
def tar(members, fmt=tarfile.USTAR_FORMAT):
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode="w", format=fmt) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            t.addfile(info, io.BytesIO(data))
    return b.getvalue()


put("tar", "seed-pairs", tar([("000000.png", b"\x89PNG fake"), ("000000.txt", b"a red circle"), ("000001.txt", b"")]))
put("tar", "seed-ustar-prefix", tar([("d" * 120 + "/000001.png", b"x" * 600)]))
put("tar", "seed-gnu-longname", tar([("l" * 150 + ".txt", b"long")], tarfile.GNU_FORMAT))
put("tar", "seed-pax", tar([("p" * 120 + "/\u00e9.txt", b"pax")], tarfile.PAX_FORMAT))


# image: PNGs (RGB, gray, RGBA, palette, 16-bit) written by hand; JPEGs through PIL if present
def png(w, h, color_type, bit_depth, raw_rows, plte=None):
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, 0)
    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
    if plte:
        out += chunk(b"PLTE", plte)
    return out + chunk(b"IDAT", zlib.compress(b"".join(b"\x00" + r for r in raw_rows))) + chunk(b"IEND", b"")


put("image", "seed-rgb.png", png(4, 3, 2, 8, [bytes(sum(([x * 60, y * 80, 128] for x in range(4)), [])) for y in range(3)]))
put("image", "seed-gray.png", png(5, 2, 0, 8, [bytes(range(y * 5, y * 5 + 5)) for y in range(2)]))
put("image", "seed-rgba.png", png(2, 2, 6, 8, [bytes([10, 20, 30, 0, 10, 20, 30, 255])] * 2))
put("image", "seed-palette.png", png(3, 1, 3, 8, [bytes([0, 1, 2])], plte=bytes([255, 0, 0, 0, 255, 0, 0, 0, 255])))
put("image", "seed-16bit.png", png(2, 1, 2, 16, [bytes(12)]))
try:
    from PIL import Image
    for mode, name in [("RGB", "seed-rgb.jpg"), ("L", "seed-gray.jpg")]:
        im = Image.new(mode, (8, 6))
        im.putdata([(x * 30 % 256, y * 40, 90) if mode == "RGB" else (x * 30 % 256) for y in range(6) for x in range(8)])
        b = io.BytesIO()
        im.save(b, "JPEG", quality=90)
        put("image", name, b.getvalue())
    b = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 40, 90)).save(b, "JPEG", progressive=True)
    put("image", "seed-progressive.jpg", b.getvalue())
except ImportError:
    print("make_corpus.py: no PIL (python3-pil): JPEG seeds left as they are")

# manifest: what the checkpoint node writes, and near misses
ok = {"format": "flowrun-checkpoint", "version": 1, "step": 500, "graph": "graphs/gpt.yaml", "name": "gpt",
      "states": {"model.params": "model.params.safetensors", "opt.state": "opt.state.safetensors"},
      "rng": "rng.safetensors", "config": "run: {steps: 1000}\n"}
put("manifest", "seed-ok.json", json.dumps(ok, indent=2))
put("manifest", "seed-negative-step.json", json.dumps(dict(ok, step=-5)))
put("manifest", "seed-escape.json", json.dumps(dict(ok, states={"m.p": "../x"})))
put("manifest", "seed-wrong-shape.json", "[1, 2, 3]")
put("manifest", "seed-duplicate-key.json", json.dumps(ok)[:-1] + ', "step": 7}')
# version 2 (per-rank files, issue 72): chunks of whole tensors, files with sizes and checksums
v2 = {"format": "flowrun-checkpoint", "version": 2, "step": 6, "world": 2, "mesh": {"dp": 2, "tp": 1, "pp": 1},
      "rng": "rng.safetensors",
      "files": {"m.rank00000.safetensors": {"bytes": 100, "crc32c": "0000abcd", "rank": 0, "host": "a"},
                "m.rank00001.safetensors": {"bytes": 90, "crc32c": "1234abcd", "rank": 1, "host": "b"},
                "rng.safetensors": {"bytes": 80, "crc32c": "deadbeef", "rank": 0, "host": "a"}},
      "states": {"model.params": {"tensors": {
          "w": {"dtype": "F32", "shape": [4, 3], "chunks": [
              {"file": "m.rank00000.safetensors", "key": "w[0:2,0:3]", "offsets": [0, 0], "sizes": [2, 3], "crc32c": "deadbeef"},
              {"file": "m.rank00001.safetensors", "key": "w[2:4,0:3]", "offsets": [2, 0], "sizes": [2, 3], "crc32c": "feedf00d"}]},
          "step": {"dtype": "I64", "shape": [], "chunks": [
              {"file": "m.rank00001.safetensors", "key": "step", "offsets": [], "sizes": [], "crc32c": "00000001"}]}}}}}
put("manifest", "seed-v2.json", json.dumps(v2, indent=1))
v2_overlap = json.loads(json.dumps(v2))
v2_overlap["states"]["model.params"]["tensors"]["w"]["chunks"][1]["offsets"] = [1, 0]
put("manifest", "seed-v2-overlap.json", json.dumps(v2_overlap))

# wordpiece: vocab lines, NUL, text; or text alone (the fuzzer's fixed vocab)
vocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\nun\n##aff\n##able\ncat\n##s\n"
put("wordpiece", "seed-vocab-text", vocab + "\x00The unaffable cats [SEP] sat.")
put("wordpiece", "seed-text", "Caf\u00e9 CAF\u00c9 \u732b\u4e2dcat, wait\u2014what!\t\x01" + "a" * 120)
put("wordpiece", "seed-no-specials", "the\ncat\n\x00the cat")

# bpe: even first byte = text for the fixed small vocab; odd = vocab.json NUL merges.txt
put("bpe", "seed-text", b"\x00the thing at the inn\n  \xe4\xb8\xad\xff\xfe 'll 're 123")
put("bpe", "seed-vocab", b"\x01" + json.dumps({chr(c): i for i, c in enumerate(range(33, 127))}).encode() +
    b"\x00#version: 0.2\nt h\n")
# npz: IndexKits' indices_file, as np.savez (stored) and np.savez_compressed (deflated) write it
def npy(descr, values, fmt):
    header = "{'descr': '%s', 'fortran_order': False, 'shape': (%d,), }" % (descr, len(values))
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + struct.pack("<%d%s" % (len(values), fmt), *values)


def npz(arrays, compress):
    import zipfile
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as z:
        for name, data in arrays:
            z.writestr(zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0)), data,
                       compress_type=zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED)
    return b.getvalue()


put("npz", "seed-compressed", npz([("x", npy("<i8", [0, 1, 2, 8, 8, 13], "q"))], True))
put("npz", "seed-stored-buckets", npz([("64x64", npy("<i8", [0, 9, 9], "q")), ("48x80", npy("<i4", [1, 3, -1], "i"))], False))
put("npz", "seed-uint16", npz([("x", npy("<u2", [1, 65535], "H"))], True))
with open(os.path.join(ROOT, "tests", "fixtures", "arrow", "index_multireso.index.npz"), "rb") as f:
    put("npz", "seed-indexkits-zip64", f.read())  # numpy's own, zip64 local headers

print("corpora written under", os.path.join(HERE, "corpus"))
