#!/usr/bin/env python3
"""Checks that files are valid safetensors files, independently of Ferry's C++.

Written from the safetensors format description alone (standard library
only), so that a bug shared by Ferry's writer and Ferry's parser cannot hide:

  8 bytes   little-endian u64 N, the header length
  N bytes   a UTF-8 JSON object starting with '{' (trailing spaces allowed):
            "__metadata__" (optional) maps strings to strings; every other
            key names a tensor {"dtype", "shape", "data_offsets": [begin, end]}
            with offsets relative to the end of the header
  rest      the tensor bytes: the entries, ordered by offset, must cover it
            exactly, without gaps or overlaps

Usage: check_safetensors.py [--align N] FILE...
Prints "ok FILE (K entries)" per good file; exits 1 naming the first problem
of every bad file, 2 on bad usage.
"""

import argparse
import json
import os
import struct
import sys

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
MAX_HEADER = 100_000_000  # the reference implementation's limit
ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}


class Invalid(Exception):
    pass


def _no_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise Invalid(f"duplicate JSON key {key!r}")
        seen[key] = value
    return seen


def _no_constants(name):
    raise Invalid(f"non-standard JSON constant {name}")


def _is_uint(v):
    # bool is an int subclass in Python; JSON true is not a number.
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_file(path, align=None):
    """Returns the number of entries, or raises Invalid naming the problem."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise Invalid(f"file is {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER:
            raise Invalid(f"header length {n} exceeds {MAX_HEADER}")
        if n > size - 8:
            raise Invalid(f"header length {n} runs past the end of the {size}-byte file")
        raw = f.read(n)
    if len(raw) != n:
        raise Invalid(f"could read only {len(raw)} of {n} header bytes")
    if not raw.startswith(b"{"):
        raise Invalid("header does not start with '{'")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Invalid(f"header is not UTF-8: {e}") from None
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates,
                            parse_constant=_no_constants)
    except json.JSONDecodeError as e:
        raise Invalid(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise Invalid("header is not a JSON object")

    data_start = 8 + n
    if align and data_start % align:
        raise Invalid(f"data starts at {data_start}, not a multiple of {align}")

    metadata = header.pop("__metadata__", None)
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise Invalid("__metadata__ is not an object")
        for k, v in metadata.items():
            if not isinstance(v, str):
                raise Invalid(f"__metadata__ value of {k!r} is not a string")

    spans = []
    for name, entry in header.items():
        where = f"entry {name!r}"
        if not isinstance(entry, dict):
            raise Invalid(f"{where} is not an object")
        missing = ENTRY_FIELDS - entry.keys()
        extra = entry.keys() - ENTRY_FIELDS
        if missing:
            raise Invalid(f"{where} lacks {sorted(missing)}")
        if extra:
            raise Invalid(f"{where} has unexpected fields {sorted(extra)}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise Invalid(f"{where} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise Invalid(f"{where} shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_uint(o) for o in offsets)):
            raise Invalid(f"{where} data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        if begin > end:
            raise Invalid(f"{where} data_offsets [{begin}, {end}] are reversed")
        nbytes = DTYPE_SIZES[dtype]
        for d in shape:
            nbytes *= d
        if end - begin != nbytes:
            raise Invalid(f"{where}: shape {shape} of {dtype} is {nbytes} bytes, "
                          f"data_offsets span {end - begin}")
        spans.append((begin, end, name))

    expected = 0
    for begin, end, name in sorted(spans):
        if begin != expected:
            kind = "overlaps the previous entry" if begin < expected else "leaves a gap"
            raise Invalid(f"entry {name!r} starts at {begin}, expected {expected}: {kind}")
        expected = end
    if expected != size - data_start:
        raise Invalid(f"entries cover {expected} data bytes, the file holds {size - data_start}")
    return len(spans)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--align", type=int, default=None,
                        help="also require the data to start at a multiple of this")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    failed = False
    for path in args.files:
        try:
            count = check_file(path, args.align)
            print(f"ok {path} ({count} entries)")
        except Invalid as e:
            print(f"INVALID {path}: {e}", file=sys.stderr)
            failed = True
        except OSError as e:
            print(f"INVALID {path}: {e}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
