"""What a dietserve or tuner process does first, before anything imports TVM."""

from __future__ import annotations

import importlib.abc
import sys


class _TorchKeptOut(importlib.abc.MetaPathFinder):
    """Answers every import of torch with ModuleNotFoundError, as if it were not installed. (Not a
    None in ``sys.modules``: scipy's array API helpers take any entry there for the module, and
    scipy.stats, which xgboost imports through scikit-learn, then fails at its import.)"""

    def find_spec(self, name: str, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (kept out of this process)", name=name)
        return None


def keep_torch_out() -> None:
    """Makes torch unimportable in this process. Wherever torch is installed, tvm_ffi imports it at
    its own import (for a DLPack interop nothing here uses): seconds and hundreds of MiB more for
    the server, its re-tuning jobs and every measurement worker. For processes that never use
    torch only: the tests and benchmarks that compare with it do not call this."""
    if "torch" not in sys.modules and not any(isinstance(f, _TorchKeptOut) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchKeptOut())
