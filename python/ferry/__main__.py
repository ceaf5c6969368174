"""python3 -m ferry export CKPT OUT [--max-shard-bytes N]: see ferry.export."""

import argparse
import sys

import ferry


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m ferry")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="consolidated safetensors + model.safetensors.index.json")
    ex.add_argument("checkpoint", help="a step directory, or a root (its latest)")
    ex.add_argument("out", help="output directory")
    ex.add_argument("--max-shard-bytes", type=int, default=5 << 30)
    args = ap.parse_args(argv)
    try:
        print(ferry.export(args.checkpoint, args.out, max_shard_bytes=args.max_shard_bytes))
    except ferry.FerryError as e:
        print("ferry export: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
