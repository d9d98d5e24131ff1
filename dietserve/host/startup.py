"""What a dietserve or tuner process does first, before anything imports TVM."""

from __future__ import annotations

import sys


def keep_torch_out() -> None:
    """Marks torch absent in this process. Wherever torch is installed, tvm_ffi imports it at its
    own import (for a DLPack interop nothing here uses): seconds and hundreds of MiB more for the
    server, its re-tuning jobs and every measurement worker. For processes that never use torch
    only: the tests and benchmarks that compare with it do not call this."""
    sys.modules.setdefault("torch", None)
