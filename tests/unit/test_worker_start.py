"""A measurement worker starts without importing PyTorch: tvm_ffi imports it wherever it is
installed (as here, for the tests), and that import is most of a worker's start, paid by every
tune and every worker restarted after a crash. The tuner imported as a library (as in this
process) keeps torch importable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_worker_process_runs_tvm_without_torch_and_the_tuner_keeps_it() -> None:
    probe = ("import runpy, sys\n"
             "runpy.run_module('tuner.measure.worker', run_name='__main__')  # (stdin at EOF: returns)\n"
             "import tvm\n"
             "sys.stderr.write(f\"torch={sys.modules.get('torch', 'absent')} tvm={tvm.__version__}\")\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch=absent tvm=0.27" in done.stderr, done.stderr[-2000:]
    import tuner.measure.worker  # noqa: F401 - imported as a module, not run: torch left alone

    assert sys.modules.get("torch", "absent") is not None


def test_a_process_without_torch_still_imports_what_imports_scipy_stats() -> None:
    """A tune's process imports xgboost, which imports scikit-learn where it is installed, which
    imports scipy.stats: that import failed while torch was kept out by a None in sys.modules."""
    probe = ("import sys\n"
             "from dietserve.host.startup import keep_torch_out\n"
             "keep_torch_out()\n"
             "import tvm, scipy.stats, xgboost\n"
             "try:\n    import torch\nexcept ModuleNotFoundError as err:\n    print('refused:', err)\n"
             "print('torch' in sys.modules, scipy.stats.norm.cdf(0.0))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["refused: No module named 'torch' (kept out of this process)", "False 0.5"]
