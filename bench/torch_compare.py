#!/usr/bin/env python3
"""Side by side on one disk, in one run: torch.save + fsync, DCP
save_state_dict with FileSystemWriter (and async_save where torch has it),
ferry.save_async, and a raw O_DIRECT writer / reader of the same bytes as
the ceiling.

For each saver: how long the training loop is blocked, the time until the
checkpoint is durable, and the peak RSS it added; then each one's load time
after its files were evicted from the page cache (posix_fadvise DONTNEED).
Every tool runs in a child process of its own (so peak RSS is its own),
building the same state dict. Ferry's runtime lives as long as the job, so
its figures are those of its second save; the first one (which also faults
the staging pool in) is reported as first_*, and the best of three more
(a training loop's steady state) as steady_*. The last line is one JSON
object with every figure and the ratios.

    PYTHONPATH=python python3 bench/torch_compare.py --gib 2 --dir /data/bench
    ... --small            # 2,000 small tensors instead of ~120 large ones
    ... --tensors 50000 --large 40   # a model's shape: 40 large tensors hold
                                     # half the bytes, 49,960 small ones the rest

Loads are timed `--load-runs` times (default 3) and reported as the median:
into fresh tensors (load_s: torch.load's own, DCP's and Ferry's into
torch.empty_like tensors whose pages were never touched, as at a job's
first load; fresh_targets says which share of them was) and into tensors
already touched (load_touched_s: the usual resume, the model initialised
first; torch.load then copy_ into them). The children run with glibc's
mmap threshold fixed, so tensors freed by one run come back fresh in the
next instead of as heap memory already faulted in.

Beside the throughput, Ferry's per-save fixed costs (they grow with the
tensor count, not the bytes) are printed: save_async's return on the first
save, the second and the steady state, and the C++ plan and commit phases.
"""

import argparse
import ctypes
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ALIGN = 4096
RAW_BLOCK = 8 << 20


def tensor_count(args):
    return args.tensors or (2000 if args.small else 120)


def build_state(gib, n, large=0, seed=0):
    """n float32 tensors of `gib` GiB; with large > 0, the first `large`
    share half of it and the others (small, one of three a vector) the rest."""
    import torch

    total = int(gib * (1 << 30))
    torch.manual_seed(seed)
    sd = {}
    for i in range(n):
        if large:
            per = max(1, total // 2 // (4 * large)) if i < large else \
                max(1, total // 2 // (4 * (n - large)))
        else:
            per = max(1, total // (4 * n))
        cols = 1024 if per >= 4096 else (per if i % 3 == 0 else 1)
        rows = max(1, per // cols)
        t = torch.empty(rows, cols, dtype=torch.float32)
        t.uniform_(-1, 1)
        sd["layers.%06d.weight" % i] = t
    return sd


def assert_same(target, sd):
    """Every tensor loaded back equal (a load that misses one is no figure)."""
    import torch

    bad = [k for k, v in sd.items() if not torch.equal(target[k], v)]
    assert not bad, "%d tensors differ after the load, e.g. %s" % (len(bad), bad[0])


def state_bytes(sd):
    return sum(t.numel() * t.element_size() for t in sd.values())


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def evict(path):
    """Drops a file's (or a directory's files') pages from the page cache."""
    paths = []
    if os.path.isdir(path):
        for d, _, files in os.walk(path):
            paths += [os.path.join(d, f) for f in files]
    else:
        paths = [path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def touched_like(sd):
    """Tensors of sd's shapes whose pages are all there (a model initialised
    before its checkpoint is loaded)."""
    import torch

    return {k: torch.empty_like(v).fill_(0.5) for k, v in sd.items()}


_libc = None


def fresh_share(target):
    """Of the tensors of 2 MiB or more in `target`, the share of bytes in
    those whose last whole page is not there yet (mincore): 1.0 when every
    large target is fresh memory, the case load_s claims to time."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = os.sysconf("SC_PAGE_SIZE")
    fresh = total = 0
    vec = ctypes.create_string_buffer(1)
    for t in target.values():
        n = t.numel() * t.element_size()
        if n < (2 << 20):
            continue
        last = (t.data_ptr() + n) // page * page - page
        total += n
        if _libc.mincore(last, page, vec) == 0 and not (vec.raw[0] & 1):
            fresh += n
    return round(fresh / total, 3) if total else None


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def timed_loads(args, path, sd, fresh, touched):
    """Runs `fresh()` and `touched()` (each returns the loaded state dict
    and its seconds) args.load_runs times, alternating, the files evicted
    before each; the medians and every run's time."""
    out = {"load_runs_s": [], "load_touched_runs_s": [], "load_cpu_runs_s": []}
    for _ in range(args.load_runs):
        for key, fn in (("load_runs_s", fresh), ("load_touched_runs_s", touched)):
            if fn is None:
                continue
            evict(path)
            c0 = time.process_time()
            loaded, secs = fn()
            if key == "load_runs_s":  # the process's CPU (every thread): steadier than wall here
                out["load_cpu_runs_s"].append(time.process_time() - c0)
            assert_same(loaded, sd)
            del loaded
            out[key].append(secs)
    out["load_s"] = median(out["load_runs_s"])
    out["load_cpu_s"] = median(out["load_cpu_runs_s"])
    if out["load_touched_runs_s"]:
        out["load_touched_s"] = median(out["load_touched_runs_s"])
    else:
        del out["load_touched_runs_s"]
    return out


def timed_loads_into(args, path, sd, load_into):
    """timed_loads of `load_into(target)`, which fills a given state dict:
    into fresh torch.empty_like tensors and into touched ones. fresh_targets:
    the least share of the fresh targets' pages not yet in memory."""
    import torch

    shares = []

    def fresh():
        target = {k: torch.empty_like(v) for k, v in sd.items()}
        shares.append(fresh_share(target))
        return load_into(target)

    out = timed_loads(args, path, sd, fresh, lambda: load_into(touched_like(sd)))
    out["fresh_targets"] = min((x for x in shares if x is not None), default=None)
    return out


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tensor_view(t):
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


# --- the tools, each run in a child process ----------------------------------------


def run_torch(sd, d, args):
    import torch

    path = os.path.join(d, "model.pt")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(d)
    t1 = time.perf_counter()
    out = {"blocked_s": t1 - t0, "durable_s": t1 - t0, "peak_rss_after_save": peak_rss_bytes()}

    def fresh():
        t0 = time.perf_counter()
        loaded = torch.load(path, map_location="cpu")
        return loaded, time.perf_counter() - t0

    def touched():
        target = touched_like(sd)
        t0 = time.perf_counter()
        loaded = torch.load(path, map_location="cpu")
        with torch.no_grad():
            for k, v in target.items():
                v.copy_(loaded[k])
        secs = time.perf_counter() - t0
        del loaded
        return target, secs

    out.update(timed_loads(args, path, sd, fresh, touched))
    return out


def _dcp():
    import ferry.torch_compat

    ferry.torch_compat.enable()
    try:
        import torch.distributed.checkpoint as dcp  # torch >= 2.0
    except ImportError:
        import torch.distributed._shard.checkpoint as dcp  # torch 1.13
    return dcp


def run_dcp(sd, d, args):
    dcp = _dcp()
    path = os.path.join(d, "dcp")
    t0 = time.perf_counter()
    writer = dcp.FileSystemWriter(path)
    if hasattr(dcp, "save"):  # torch >= 2.2: no process group means one process
        dcp.save(sd, storage_writer=writer)
    else:
        dcp.save_state_dict(sd, writer, no_dist=True)
    fsync_path(path)
    t1 = time.perf_counter()
    out = {"blocked_s": t1 - t0, "durable_s": t1 - t0, "peak_rss_after_save": peak_rss_bytes()}

    def load_into(target):
        t0 = time.perf_counter()
        reader = dcp.FileSystemReader(path)
        if hasattr(dcp, "load"):
            dcp.load(target, storage_reader=reader)
        else:
            dcp.load_state_dict(target, reader, no_dist=True)
        return target, time.perf_counter() - t0

    out.update(timed_loads_into(args, path, sd, load_into))
    return out


def run_dcp_async(sd, d, args):
    dcp = _dcp()
    if not hasattr(dcp, "async_save"):
        return {"skipped": "this torch has no DCP async_save"}
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(d, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    path = os.path.join(d, "dcp_async")
    t0 = time.perf_counter()
    fut = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(path))
    t1 = time.perf_counter()
    fut.result()
    fsync_path(path)
    t2 = time.perf_counter()
    return {"blocked_s": t1 - t0, "durable_s": t2 - t0, "peak_rss_after_save": peak_rss_bytes()}


def run_ferry(sd, d, args):
    import ferry

    opts = {"pool_bytes": str(args.pool_bytes or _round_up(state_bytes(sd), 8 << 20))}
    rt = ferry.Runtime(opts, rank=0, world_size=1)
    try:
        root = os.path.join(d, "ferry")
        # A job starts its runtime once and checkpoints many times: the first
        # save also pays for faulting the pool in (and the actors' start),
        # which later saves do not. It is reported apart; the figures that
        # the ratios use are the second save's.
        t0 = time.perf_counter()
        first = rt.save_async(sd, root, 1)
        tr = time.perf_counter()
        first.wait_snapshot()
        t1 = time.perf_counter()
        first.wait()
        first_s = {"first_blocked_s": tr - t0, "first_blocked_snapshot_s": t1 - t0,
                   "first_durable_s": time.perf_counter() - t0}
        t0 = time.perf_counter()
        h = rt.save_async(sd, root, 2)
        t1 = time.perf_counter()
        h.wait_snapshot()
        t2 = time.perf_counter()
        path = h.wait()
        t3 = time.perf_counter()
        out = {
            "blocked_s": t1 - t0,
            "blocked_snapshot_s": t2 - t0,
            "durable_s": t3 - t0,
            "peak_rss_after_save": peak_rss_bytes(),
            "metrics": h.metrics(),
        }
        out.update(first_s)
        # Later saves, the steady state of a training loop (the best of
        # three: a shared machine only adds): the save cache is warm and the
        # plan and the manifest are refilled from the last save's.
        steady = []
        for step in (3, 4, 5):
            t0 = time.perf_counter()
            hs = rt.save_async(sd, root, step)
            t1 = time.perf_counter()
            hs.wait()
            steady.append((t1 - t0, time.perf_counter() - t0, hs.metrics()))
        out["steady_blocked_s"] = min(s[0] for s in steady)
        out["steady_durable_s"] = min(s[1] for s in steady)
        m = out["metrics"]
        # The per-save fixed costs, in ms: what grows with the tensor count.
        out["fixed_ms"] = {
            "save_async_first": round(first_s["first_blocked_s"] * 1e3, 3),
            "save_async": round(out["blocked_s"] * 1e3, 3),
            "save_async_steady": round(out["steady_blocked_s"] * 1e3, 3),
            "cpp_save_async": round(m["save_async_ms"], 3),
            "plan": round(m["plan_ms"], 3),
            "commit": round(m["commit_ms"], 3),
            "plan_steady": round(min(s[2]["plan_ms"] for s in steady), 3),
            "commit_steady": round(min(s[2]["commit_ms"] for s in steady), 3),
        }

        def load_into(target):
            t0 = time.perf_counter()
            rt.load(target, path)
            return target, time.perf_counter() - t0

        out.update(timed_loads_into(args, path, sd, load_into))
    finally:
        rt.close()
    return out


def _round_up(n, a):
    return (n + a - 1) // a * a


def run_raw(sd, d, args):
    """O_DIRECT writes of the same bytes from an aligned staging buffer (the
    copy into it included, as any saver must read the tensors), one fsync;
    then O_DIRECT reads back into aligned memory."""
    path = os.path.join(d, "raw.bin")
    buf = mmap.mmap(-1, RAW_BLOCK)
    view = memoryview(buf)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    t0 = time.perf_counter()
    fill = 0
    total = 0
    for t in sd.values():
        src = tensor_view(t)
        pos = 0
        while pos < len(src):
            n = min(RAW_BLOCK - fill, len(src) - pos)
            view[fill:fill + n] = src[pos:pos + n]
            fill += n
            pos += n
            if fill == RAW_BLOCK:
                os.write(fd, view)
                total += fill
                fill = 0
    if fill:
        padded = _round_up(fill, ALIGN)
        view[fill:padded] = bytes(padded - fill)
        os.write(fd, view[:padded])
        total += fill
    os.fsync(fd)
    os.close(fd)
    os.truncate(path, total)
    fsync_path(d)
    t1 = time.perf_counter()
    out = {"durable_s": t1 - t0, "blocked_s": t1 - t0, "peak_rss_after_save": peak_rss_bytes()}
    runs = []
    for _ in range(args.load_runs):
        evict(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        dst = mmap.mmap(-1, _round_up(total, ALIGN))  # fresh pages, each run
        dview = memoryview(dst)
        t0 = time.perf_counter()
        off = 0
        while off < total:
            n = os.readv(fd, [dview[off:off + RAW_BLOCK]])
            if n <= 0:
                break
            off += n
        runs.append(time.perf_counter() - t0)
        os.close(fd)
        dview.release()
        dst.close()
    out["load_runs_s"] = runs
    out["load_s"] = median(runs)
    return out


TOOLS = {
    "torch_save": run_torch,
    "dcp": run_dcp,
    "dcp_async": run_dcp_async,
    "ferry": run_ferry,
    "raw_odirect": run_raw,
}


def worker(args):
    sd = build_state(args.gib, tensor_count(args), args.large)
    base = rss_bytes()
    d = os.path.join(args.dir, args.worker)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    try:
        out = TOOLS[args.worker](sd, d, args)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if "peak_rss_after_save" in out:
        out["added_rss_bytes"] = max(0, out.pop("peak_rss_after_save") - base)
    out["state_bytes"] = state_bytes(sd)
    print("RESULT " + json.dumps(out), flush=True)


def ratio(a, b):
    return round(a / b, 2) if a and b else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/ferry_torch_compare", help="on the disk to measure")
    ap.add_argument("--gib", type=float, default=2.0, help="state dict size")
    ap.add_argument("--small", action="store_true", help="2,000 small tensors")
    ap.add_argument("--tensors", type=int, default=0, help="tensor count (default 120, "
                    "2,000 with --small)")
    ap.add_argument("--large", type=int, default=0, help="of them, large ones holding half the "
                    "state (the rest small)")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--pool-bytes", default=None, help="Ferry's pool (default: the state's size)")
    ap.add_argument("--load-runs", type=int, default=3, help="loads timed per tool and target "
                    "kind (fresh, touched); the median is reported")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.large and args.large >= tensor_count(args):
        ap.error("--large must be fewer than the tensors (%d)" % tensor_count(args))
    if args.worker:
        return worker(args)

    try:
        import torch  # noqa: F401
    except ImportError:
        print("SKIP: torch is not importable from %s" % sys.executable)
        return 77
    os.makedirs(args.dir, exist_ok=True)
    results = {}
    for tool in args.tools.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", tool, "--dir", args.dir,
               "--gib", str(args.gib), "--tensors", str(tensor_count(args)),
               "--large", str(args.large), "--load-runs", str(args.load_runs)]
        if args.pool_bytes:
            cmd += ["--pool-bytes", args.pool_bytes]
        # A fixed threshold: glibc otherwise raises it when a large tensor is
        # freed, and the next run's tensors come from heap pages in use.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env)
        line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            results[tool] = {"error": p.stdout.strip().splitlines()[-1] if p.stdout.strip() else
                             "exit %d" % p.returncode}
        else:
            results[tool] = json.loads(line[len("RESULT "):])
        r = results[tool]
        print("%-12s %s" % (tool, "  ".join(
            "%s=%s" % (k, ("%.3f" % v) if isinstance(v, float) else v)
            for k, v in r.items() if k not in ("metrics",) and not k.endswith("runs_s"))),
            flush=True)

    def get(tool, key):
        return results.get(tool, {}).get(key)

    gb = (get("ferry", "state_bytes") or get("torch_save", "state_bytes") or 0) / 1e9
    summary = {
        "bench": "torch_compare",
        "state_gb": round(gb, 3),
        "tensors": tensor_count(args),
        "large": args.large,
        "load_runs": args.load_runs,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "ferry_fixed_ms": get("ferry", "fixed_ms"),
        "results": results,
        "ratios": {
            "durable_torch_save_over_ferry": ratio(get("torch_save", "durable_s"), get("ferry", "durable_s")),
            "durable_dcp_over_ferry": ratio(get("dcp", "durable_s"), get("ferry", "durable_s")),
            "blocked_torch_save_over_ferry_return": ratio(get("torch_save", "blocked_s"), get("ferry", "blocked_s")),
            "blocked_torch_save_over_ferry_snapshot": ratio(get("torch_save", "blocked_s"), get("ferry", "blocked_snapshot_s")),
            "load_torch_over_ferry": ratio(get("torch_save", "load_s"), get("ferry", "load_s")),
            "load_cpu_torch_over_ferry": ratio(get("torch_save", "load_cpu_s"),
                                               get("ferry", "load_cpu_s")),
            "load_dcp_over_ferry": ratio(get("dcp", "load_s"), get("ferry", "load_s")),
            "load_touched_torch_copy_over_ferry": ratio(get("torch_save", "load_touched_s"),
                                                        get("ferry", "load_touched_s")),
            "load_touched_dcp_over_ferry": ratio(get("dcp", "load_touched_s"),
                                                 get("ferry", "load_touched_s")),
            "ferry_durable_over_raw_odirect": ratio(get("ferry", "durable_s"), get("raw_odirect", "durable_s")),
            "ferry_load_over_raw_odirect": ratio(get("ferry", "load_s"), get("raw_odirect", "load_s")),
        },
        "targets": {
            "durable_torch_save_over_ferry": ">= 2.5",
            "durable_dcp_over_ferry": ">= 4",
            "blocked_torch_save_over_ferry_snapshot": ">= 8",
            "load_torch_over_ferry": ">= 1.5",
            "load_dcp_over_ferry": ">= 1.5",
            "load_touched_torch_copy_over_ferry": ">= 2",
        },
    }
    print(json.dumps(summary), flush=True)
    # A tool that failed (or loaded wrong bytes) fails the run: no figure.
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
