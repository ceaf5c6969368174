"""CUDA tensors through the C ABI: a state dict on the GPU saved and loaded
back into GPU tensors (and into CPU ones), bytes compared. Skipped (77)
when torch has no usable GPU, unless FERRY_REQUIRE_GPU=1: then it fails."""

import os
import shutil
import sys
import tempfile

import _support  # noqa: F401 (exits 77, skipped, without torch)
import torch  # noqa: E402

if not torch.cuda.is_available():
    if os.environ.get("FERRY_REQUIRE_GPU") == "1":
        print("FAIL: FERRY_REQUIRE_GPU=1 but torch sees no GPU")
        sys.exit(1)
    print("SKIP: torch sees no GPU (FERRY_REQUIRE_GPU=1 makes this a failure)")
    sys.exit(77)

import ferry

ferry.configure(pool_bytes="64MiB", chunk_bytes="4MiB")


def main():
    root = tempfile.mkdtemp(prefix="ferry_py_cuda_")
    try:
        g = torch.Generator(device="cuda").manual_seed(3)
        sd = {
            "w": torch.randn(1024, 1024, device="cuda", generator=g),
            "h": torch.randn(333, 77, device="cuda", generator=g).half(),
            "t": torch.randn(64, 32, device="cuda", generator=g).t(),  # non-contiguous
            "cpu": torch.arange(10),
        }
        h = ferry.save_async(sd, root, 1)
        h.wait_snapshot()
        expect = {k: v.clone() for k, v in sd.items()}
        sd["w"].add_(1)  # after the snapshot the GPU tensor may change
        h.wait()
        back = {k: torch.empty_like(v) for k, v in expect.items()}
        ferry.load(back, root)
        torch.cuda.synchronize()
        for k in expect:
            assert torch.equal(back[k], expect[k]), k
        host = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in expect.items()}
        ferry.load(host, root)
        for k in expect:
            assert torch.equal(host[k], expect[k].cpu()), k
        print("cuda round trip: ok (%s)" % torch.cuda.get_device_name(0))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
