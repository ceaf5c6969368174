#!/usr/bin/python3
"""Compare global save planning: torch DCP (1.13) against Ferry's make_global_plan.

Builds, for each rank count R, the same synthetic model as
`ferry_bench_plan --shape sharded`: 500 bf16 tensors, each row-sharded across
all R ranks (rows = 16*R + i%7, so some shards are one row longer), and turns
every rank's shards into a DCP SavePlan of WriteItemType.SHARD items (same
key on every rank, chunk offsets/sizes per rank). It then times
DefaultSavePlanner().create_global_plan(plans), best of --dcp-reps, with plan
building kept outside the clock, and runs Ferry's bench binary on the same
shape to get its figure.

    /usr/bin/python3 bench/dcp_plan_compare.py [--ranks 64,256,1024]
        [--items 500] [--dcp-reps 3] [--ferry-reps 5]
        [--ferry-bench build/bench/ferry_bench_plan] [--gc on|off]

Prints a table, then one JSON line (the last line of stdout).

torch 1.13 does not import DCP on Python 3.11: one dataclass field in
torch/distributed/_shard/sharded_tensor/metadata.py has a mutable default
(`field(default=TensorProperties())`). A meta path finder below loads that
module from its source with the field changed to
`field(default_factory=TensorProperties)`, in memory only; the installed file
and its cached bytecode are not touched. Where torch is missing the script
says so and exits 0 with a "skipped" JSON line.
"""

import argparse
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

BENCH = "dcp_plan_compare"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_SPEEDUP = 100.0
TARGET_FERRY_MS = 25.0

# ---------------------------------------------------------------------------
# Python 3.11 workaround for torch 1.13's sharded_tensor metadata module.

_PATCH_MODULE = "torch.distributed._shard.sharded_tensor.metadata"
_PATCH_OLD = "field(default=TensorProperties())"
_PATCH_NEW = "field(default_factory=TensorProperties)"


class _PatchedSourceLoader(importlib.abc.Loader):
    """Executes a module from source text that was fixed up in memory."""

    def __init__(self, path, source):
        self._path = path
        self._source = source

    def create_module(self, spec):
        return None  # default module creation

    def exec_module(self, module):
        # Compiled straight from the patched text: the installed __pycache__
        # entry holds the unpatched bytecode and must not be used.
        code = compile(self._source, self._path, "exec", dont_inherit=True)
        exec(code, module.__dict__)


class _TensorPropertiesDefaultFix(importlib.abc.MetaPathFinder):
    """Finds only _PATCH_MODULE; every other import goes to the usual finders."""

    def __init__(self):
        self.applied = False

    def find_spec(self, fullname, path, target=None):
        if fullname != _PATCH_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return None
        try:
            with open(spec.origin, "r", encoding="utf-8") as f:
                source = f.read()
        except OSError:
            return None
        if _PATCH_OLD not in source:
            return None  # already fixed (torch >= 2.0): import it untouched
        source = source.replace(_PATCH_OLD, _PATCH_NEW)
        self.applied = True
        return importlib.util.spec_from_file_location(
            fullname, spec.origin, loader=_PatchedSourceLoader(spec.origin, source)
        )


def import_dcp():
    """Returns (torch, dcp namespace dict, patch_applied) or raises ImportError."""
    import torch  # noqa: F401  (ImportError when torch is absent)

    finder = _TensorPropertiesDefaultFix()
    sys.meta_path.insert(0, finder)
    try:
        from torch.distributed._shard.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed._shard.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorStorageMetadata,
        )
        from torch.distributed._shard.checkpoint.planner import (
            SavePlan,
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )
        from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    finally:
        sys.meta_path.remove(finder)
    names = dict(
        DefaultSavePlanner=DefaultSavePlanner,
        ChunkStorageMetadata=ChunkStorageMetadata,
        MetadataIndex=MetadataIndex,
        TensorStorageMetadata=TensorStorageMetadata,
        SavePlan=SavePlan,
        TensorWriteData=TensorWriteData,
        WriteItem=WriteItem,
        WriteItemType=WriteItemType,
        TensorProperties=TensorProperties,
    )
    return torch, names, finder.applied


# ---------------------------------------------------------------------------
# The synthetic model, identical to ferry_bench_plan's "sharded" shape.


def model(items, ranks):
    """(key, global rows, cols) of every tensor, as in ferry_bench_plan.cpp."""
    out = []
    for i in range(items):
        key = "model.layers.%d.block.%d.weight" % (i // 10, i % 10)
        out.append((key, ranks * 16 + i % 7, 1024 + 128 * (i % 4)))
    return out


def build_dcp_plans(torch, dcp, ranks, items):
    """One SavePlan per rank, one SHARD WriteItem per tensor (its row block)."""
    Size = torch.Size
    MetadataIndex = dcp["MetadataIndex"]
    WriteItem = dcp["WriteItem"]
    TensorWriteData = dcp["TensorWriteData"]
    Chunk = dcp["ChunkStorageMetadata"]
    SHARD = dcp["WriteItemType"].SHARD
    tensors = []
    for key, rows, cols in model(items, ranks):
        props = dcp["TensorProperties"](
            dtype=torch.bfloat16,
            layout=torch.strided,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=False,
        )
        tensors.append((key, rows, cols, props, Size([rows, cols])))
    plans = []
    for r in range(ranks):
        plan_items = []
        for key, rows, cols, props, gsize in tensors:
            base, extra = divmod(rows, ranks)
            begin = r * base + min(r, extra)
            nrows = base + (1 if r < extra else 0)
            offsets = Size([begin, 0])
            plan_items.append(
                WriteItem(
                    index=MetadataIndex(key, offsets),
                    type=SHARD,
                    tensor_data=TensorWriteData(
                        chunk=Chunk(offsets=offsets, sizes=Size([nrows, cols])),
                        properties=props,
                        size=gsize,
                    ),
                )
            )
        plans.append(dcp["SavePlan"](items=plan_items))
    return plans


def check_dcp_result(dcp, result, ranks, items):
    """Sanity check of DCP's answer: every tensor has one chunk per rank."""
    new_plans, md = result
    assert len(new_plans) == ranks, "DCP returned %d plans" % len(new_plans)
    sd = md.state_dict_metadata
    assert len(sd) == items, "DCP metadata has %d entries" % len(sd)
    for key, rows, _cols in model(items, ranks):
        entry = sd[key]
        assert isinstance(entry, dcp["TensorStorageMetadata"])
        assert len(entry.chunks) == ranks, key
        assert sum(c.sizes[0] for c in entry.chunks) == rows, key


def time_dcp(torch, dcp, ranks, items, reps, gc_on):
    t0 = time.perf_counter()
    plans = build_dcp_plans(torch, dcp, ranks, items)
    build_s = time.perf_counter() - t0
    best = float("inf")
    keep = None
    for _ in range(reps):
        gc.collect()
        if not gc_on:
            gc.disable()
        try:
            planner = dcp["DefaultSavePlanner"]()
            t0 = time.perf_counter()
            result = planner.create_global_plan(plans)
            t1 = time.perf_counter()
        finally:
            gc.enable()
        best = min(best, (t1 - t0) * 1e3)
        keep = result  # the previous result is freed here, off the clock
        del result, planner
    check_dcp_result(dcp, keep, ranks, items)
    del keep, plans
    gc.collect()
    return best, build_s * 1e3


# ---------------------------------------------------------------------------
# Ferry's side: its own bench binary on the same shape.


def run_ferry(path, ranks_list, items, reps):
    cmd = [
        path,
        "--ranks", ",".join(str(r) for r in ranks_list),
        "--items", str(items),
        "--shape", "sharded",
        "--reps", str(reps),
    ]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            "%s exited with %d: %s" % (" ".join(cmd), proc.returncode, proc.stderr.strip())
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError("%s printed nothing" % path)
    try:
        doc = json.loads(lines[-1])
    except ValueError as e:
        raise RuntimeError("last line of %s is not JSON (%s): %r" % (path, e, lines[-1]))
    by_ranks = {}
    for row in doc.get("results", []):
        if row.get("shape") == "sharded" and row.get("items_per_rank") == items:
            by_ranks[int(row["ranks"])] = float(row["ms"])
    missing = [r for r in ranks_list if r not in by_ranks]
    if missing:
        raise RuntimeError("%s gave no sharded result for ranks %s" % (path, missing))
    return by_ranks, " ".join(cmd)


# ---------------------------------------------------------------------------


def parse_ranks(text):
    try:
        ranks = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError("bad rank list %r" % text)
    if not ranks or any(r <= 0 for r in ranks):
        raise argparse.ArgumentTypeError("ranks must be positive: %r" % text)
    return ranks


def positive(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("not an integer: %r" % text)
    if v <= 0:
        raise argparse.ArgumentTypeError("must be positive: %r" % text)
    return v


def emit(doc):
    print(json.dumps(doc, separators=(",", ":")))
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=parse_ranks, default=[64, 256, 1024],
                    help="comma-separated rank counts (default 64,256,1024)")
    ap.add_argument("--items", type=positive, default=500, help="tensors per rank (default 500)")
    ap.add_argument("--dcp-reps", type=positive, default=3,
                    help="DCP repetitions, best taken (default 3)")
    ap.add_argument("--ferry-reps", type=positive, default=5,
                    help="--reps passed to the Ferry bench (default 5)")
    ap.add_argument("--ferry-bench", default="build/bench/ferry_bench_plan",
                    help="Ferry plan bench binary, relative to the repo root unless absolute "
                         "(default build/bench/ferry_bench_plan)")
    ap.add_argument("--gc", choices=["on", "off"], default="on",
                    help="keep Python's cyclic GC on during DCP timing (as in real use; default) "
                         "or switch it off")
    args = ap.parse_args()

    base = {"bench": BENCH, "ranks": args.ranks, "items_per_rank": args.items}

    try:
        torch, dcp, patched = import_dcp()
    except ImportError as e:
        msg = ("torch (with torch.distributed._shard.checkpoint) is not importable from %s: %s. "
               "On Debian 12 install it with: apt-get install -y python3-torch"
               % (sys.executable, e))
        print("dcp_plan_compare: skipped: " + msg, file=sys.stderr)
        emit(dict(base, skipped=True, reason=msg))
        return 0

    ferry_bin = args.ferry_bench
    if not os.path.isabs(ferry_bin):
        ferry_bin = os.path.join(REPO_ROOT, ferry_bin)
    if not (os.path.isfile(ferry_bin) and os.access(ferry_bin, os.X_OK)):
        msg = ("Ferry bench %s not found or not executable; build it with `cmake --build <dir> "
               "--target ferry_bench_plan` and pass --ferry-bench <dir>/bench/ferry_bench_plan"
               % ferry_bin)
        print("dcp_plan_compare: error: " + msg, file=sys.stderr)
        emit(dict(base, error=msg))
        return 1

    print("torch %s on Python %s; DCP import fix %s; GC %s during DCP timing"
          % (torch.__version__, platform.python_version(),
             "applied" if patched else "not needed", args.gc))

    # Ferry first (cheap), so a broken binary fails before minutes of DCP work.
    try:
        ferry_ms, ferry_cmd = run_ferry(ferry_bin, args.ranks, args.items, args.ferry_reps)
    except (OSError, RuntimeError) as e:
        print("dcp_plan_compare: error: %s" % e, file=sys.stderr)
        emit(dict(base, error=str(e)))
        return 1
    print("ferry: %s" % ferry_cmd)

    results = []
    header = "%-7s %-6s %10s %12s %12s %10s %12s" % (
        "ranks", "items", "items_tot", "dcp_ms", "ferry_ms", "speedup", "dcp_build_ms")
    print(header)
    for ranks in args.ranks:
        dcp_ms, build_ms = time_dcp(torch, dcp, ranks, args.items, args.dcp_reps, args.gc == "on")
        f_ms = ferry_ms[ranks]
        speedup = dcp_ms / f_ms if f_ms > 0 else float("inf")
        print("%-7d %-6d %10d %12.2f %12.3f %9.1fx %12.0f" % (
            ranks, args.items, ranks * args.items, dcp_ms, f_ms, speedup, build_ms))
        sys.stdout.flush()
        results.append({
            "bench": BENCH,
            "ranks": ranks,
            "items_per_rank": args.items,
            "dcp_ms": round(dcp_ms, 3),
            "ferry_ms": round(f_ms, 3),
            "speedup": round(speedup, 1),
        })

    doc = dict(base)
    doc.update(torch=torch.__version__, python=platform.python_version(),
               dcp_import_fix=patched, dcp_reps=args.dcp_reps, ferry_reps=args.ferry_reps,
               gc=args.gc, results=results)
    for r in results:
        if r["ranks"] == 1024 and r["items_per_rank"] == 500:
            ok = r["speedup"] >= TARGET_SPEEDUP and r["ferry_ms"] <= TARGET_FERRY_MS
            print("1024x500: Ferry %.2f ms (target <= %.0f), %.1fx faster than DCP "
                  "(target >= %.0fx): %s" % (r["ferry_ms"], TARGET_FERRY_MS, r["speedup"],
                                            TARGET_SPEEDUP, "met" if ok else "NOT met"))
            doc["target_met_1024x500"] = ok
    emit(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
