"""python3 -m ferry export CKPT OUT [--max-shard-bytes SIZE]: see ferry.export."""

import argparse
import sys

import ferry

from ._size import parse_size


def _positive_size(text):
    """An argparse type: the bytes of a size in the settings' syntax (64MiB,
    1GB, 4096) above 0; argparse names the flag in the error."""
    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n == 0:
        raise argparse.ArgumentTypeError("'%s': the size must be positive" % text)
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m ferry")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="consolidated safetensors + model.safetensors.index.json")
    ex.add_argument("checkpoint", help="a step directory, or a root (its latest)")
    ex.add_argument("out", help="output directory")
    ex.add_argument("--max-shard-bytes", type=_positive_size, default=5 << 30, metavar="SIZE",
                    help="most bytes per file, e.g. 2GiB or 500MB (default 5GiB); a larger "
                         "tensor gets a file of its own")
    args = ap.parse_args(argv)
    try:
        print(ferry.export(args.checkpoint, args.out, max_shard_bytes=args.max_shard_bytes))
    except ferry.FerryError as e:
        print("ferry export: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
