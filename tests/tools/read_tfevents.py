#!/usr/bin/env python3
"""An independent reader of TensorBoard event files (standard library only), for tests.

    read_tfevents.py DIR_OR_FILE...

Reads every file whose name contains "tfevents" (in the folders given, or the files given),
checks each record's framing (8-byte little-endian length, masked CRC32C of the length, the
data, masked CRC32C of the data), decodes the tensorflow.Event protos with a generic protocol
buffer wire-format parser, checks each PNG image (signature, every chunk's CRC32, IHDR size
against the summary's height/width, the inflated IDAT size), and prints one JSON object per
event: {"file", "wall_time", "step", "file_version"?, "scalars": {tag: value},
"images": {tag: {"height", "width", "colorspace", "png_width", "png_height", "png_bytes"}},
"texts": {tag: text} (a text plugin's summary: metadata plugin "text", a DT_STRING tensor of
shape [1])}.
Exits 1 with a message naming the file and offset at the first problem.

Written from the format's description (TFRecord framing; event.proto and summary.proto field
numbers), sharing no code with flowrun's writer (nodes/formats/tfevents.cpp).
"""
import json
import os
import struct
import sys
import zlib


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class Bad(Exception):
    pass


def fields(buf):
    """Yields (field number, wire type, value) of a serialized message."""
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = varint(buf, i)
        elif wire == 1:
            v, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wire == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise Bad("wire type %d" % wire)
        if i > len(buf):
            raise Bad("field %d runs past its message" % num)
        yield num, wire, v


def varint(buf, i):
    shift = v = 0
    while True:
        if i >= len(buf):
            raise Bad("truncated varint")
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, i


def check_png(png, height, width):
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise Bad("image is not a PNG")
    i, idat, ihdr = 8, b"", None
    while i < len(png):
        n, kind = struct.unpack(">I4s", png[i:i + 8])
        body = png[i + 8:i + 8 + n]
        (crc,) = struct.unpack(">I", png[i + 8 + n:i + 12 + n])
        if zlib.crc32(kind + body) & 0xFFFFFFFF != crc:
            raise Bad("PNG chunk %r: bad CRC" % kind)
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        i += 12 + n
    w, h, depth, color = ihdr[0], ihdr[1], ihdr[2], ihdr[3]
    if (w, h) != (width, height):
        raise Bad("PNG is %dx%d, the summary says %dx%d" % (w, h, width, height))
    channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(color)
    if depth != 8 or channels is None:
        raise Bad("unexpected PNG depth %d color type %d" % (depth, color))
    if len(zlib.decompress(idat)) != h * (1 + w * channels):
        raise Bad("PNG pixel data has the wrong size")
    return w, h


def event(data, path):
    e = {"file": path, "wall_time": None, "step": 0, "scalars": {}, "images": {}, "texts": {}}
    for num, wire, v in fields(data):
        if num == 1 and wire == 1:
            e["wall_time"] = struct.unpack("<d", v)[0]
        elif num == 2 and wire == 0:
            e["step"] = v - (1 << 64) if v >= 1 << 63 else v
        elif num == 3 and wire == 2:
            e["file_version"] = v.decode()
        elif num == 5 and wire == 2:  # Summary
            for snum, _, value in fields(v):
                if snum != 1:
                    continue
                tag, simple, image, plugin, strings = None, None, None, None, None
                for vnum, vwire, x in fields(value):
                    if vnum == 1:
                        tag = x.decode()
                    elif vnum == 2 and vwire == 5:
                        simple = struct.unpack("<f", x)[0]
                    elif vnum == 4:
                        image = {1: 0, 2: 0, 3: 0, 4: b""}
                        for inum, _, y in fields(x):
                            image[inum] = y
                    elif vnum == 9:  # SummaryMetadata { plugin_data = 1 { plugin_name = 1 } }
                        for mnum, _, y in fields(x):
                            if mnum == 1:
                                plugin = next((z.decode() for pnum, _, z in fields(y) if pnum == 1), None)
                    elif vnum == 8:  # TensorProto { dtype = 1; tensor_shape = 2; string_val = 8 }
                        strings, dtype = [], None
                        for tnum, _, y in fields(x):
                            if tnum == 1:
                                dtype = y
                            elif tnum == 8:
                                strings.append(y.decode())
                        if dtype != 7:
                            raise Bad("a tensor summary of dtype %s, not DT_STRING" % dtype)
                if simple is not None:
                    e["scalars"][tag] = simple
                if strings is not None:
                    if plugin != "text" or len(strings) != 1:
                        raise Bad("tag %s: a string tensor of %d values for plugin %s" % (tag, len(strings), plugin))
                    e["texts"][tag] = strings[0]
                if image is not None:
                    pw, ph = check_png(image[4], image[1], image[2])
                    e["images"][tag] = {"height": image[1], "width": image[2], "colorspace": image[3],
                                        "png_width": pw, "png_height": ph, "png_bytes": len(image[4])}
    return e


def read(path):
    data = open(path, "rb").read()
    out, i = [], 0
    while i < len(data):
        if i + 12 > len(data):
            raise Bad("%s at %d: truncated record header" % (path, i))
        header = data[i:i + 8]
        (n,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", data[i + 8:i + 12])
        if hcrc != masked(header):
            raise Bad("%s at %d: bad length CRC" % (path, i))
        body = data[i + 12:i + 12 + n]
        if len(body) != n or i + 16 + n > len(data):
            raise Bad("%s at %d: truncated record" % (path, i))
        (dcrc,) = struct.unpack("<I", data[i + 12 + n:i + 16 + n])
        if dcrc != masked(body):
            raise Bad("%s at %d: bad data CRC" % (path, i))
        try:
            out.append(event(body, path))
        except Bad as b:
            raise Bad("%s at %d: %s" % (path, i, b))
        i += 16 + n
    return out


def main():
    files = []
    for a in sys.argv[1:]:
        if os.path.isdir(a):
            files += sorted(os.path.join(a, f) for f in os.listdir(a) if "tfevents" in f)
        else:
            files.append(a)
    if not files:
        sys.exit("read_tfevents.py: no event files in " + " ".join(sys.argv[1:]))
    try:
        for f in files:
            for e in read(f):
                print(json.dumps(e))
    except Bad as b:
        sys.exit("read_tfevents.py: " + str(b))


if __name__ == "__main__":
    main()
