"""What every Python test script needs first: torch (else the script exits
77, which ctest reports as skipped, never as passed) and the source tree."""

import os
import sys

try:
    import torch  # noqa: F401
except ImportError:
    print("SKIP: torch is not importable from %s" % sys.executable)
    sys.exit(77)

SRC = os.environ.get("FERRY_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
