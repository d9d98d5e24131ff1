"""The GPU host's side of a measurement bundle (``bundle.py``), copied into it as ``run.py``:

    python3 BUNDLE/run.py --out RESULTS

Needs python3 with numpy and a CUDA driver: no TVM compiler, no network. TVM's runtime comes
with the bundle (installed under /tmp on first run). Each job's library is loaded with the fatbin
built beside it, checked against the bundle's numpy result on its check shape, then timed on its
shapes: the median of ``--repeat`` single calls, each after the L2 cache is flushed (served, a
layer's weight was evicted by the rest of the model). One JSON line per job in
``RESULTS/results.jsonl``; a rerun skips the jobs already there (resumable).

Jobs run in a child process; when it dies (a kernel faulted, the CUDA context is lost) the next
child starts after the job it died in, which is recorded as failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

READY = "DIETSERVE_BUNDLE_RUNTIME"
RUNTIME_SITE = Path("/tmp/dietserve-bundle-runtime")
FLUSH_BYTES = 128 << 20  # over every current GPU's L2 cache
CHECK_TOLERANCE = 1e-3  # a job's own, where the bundle gives one (reduced-precision kernels)
RESULTS = "results.jsonl"


def install_runtime(package: Path, site: Path) -> dict:
    """Installs the runtime-only TVM package (``whl/`` and ``tvm-runtime.tgz``, as
    ``dietserve/host/tvm_runtime_only.py`` writes it) into ``site``; returns the environment a
    process needs to import it. Shared with ``tests/gpu/remote_check.py``."""
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    wheels = sorted(str(w) for w in (package / "whl").glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--target", str(site), *wheels], check=True)
    with tarfile.open(package / "tvm-runtime.tgz") as archive:
        archive.extractall(site, filter="data")
    # TVM_FFI_DISABLE_TORCH_C_DLPACK: else tvm_ffi builds a torch extension at import where torch is installed.
    return dict(os.environ, TVM_USE_RUNTIME_LIB="1", TVM_FFI_DISABLE_TORCH_C_DLPACK="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))


def bootstrap(bundle: Path) -> None:
    """Installs the bundle's TVM runtime under /tmp and re-executes with it, once."""
    if os.environ.get(READY) == "1":
        return
    env = dict(install_runtime(bundle, RUNTIME_SITE), **{READY: "1"})
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def call_arguments(inputs: list, output, scalars: list) -> list:
    """Inputs, the shape's scalar parameters at their positions, the output (the PrimFunc's order)."""
    arguments = [*inputs, output]
    for position, value in sorted(scalars):
        arguments.insert(position, int(value))
    return arguments


class Gpu:
    """TVM's runtime on the first GPU: loads a job's library with its prebuilt fatbin, checks and times it."""

    def __init__(self, bundle: Path, repeat: int):
        import numpy as np
        import tvm
        import tvm_ffi

        self.np, self.tvm, self.bundle, self.repeat = np, tvm, bundle, repeat
        self.device = tvm.cuda(0)
        self.name = str(self.device.device_name)
        self._fatbin: tuple[str, bytes] = ("", b"")
        tvm_ffi.register_global_func("tvm_callback_cuda_compile", self._prebuilt, override=True)
        self._scratch = tvm.runtime.empty((FLUSH_BYTES // 4,), "float32", self.device)
        self._zeros = np.zeros(FLUSH_BYTES // 4, "float32")

    def _prebuilt(self, code: str, *_unused) -> bytes:
        digest, fatbin = self._fatbin
        if hashlib.sha256(code.encode()).hexdigest() != digest:
            raise RuntimeError("the library's CUDA source is not the one its fatbin was built from")
        return fatbin

    def load(self, job: dict):
        self._fatbin = (job["source_sha256"], (self.bundle / job["fatbin"]).read_bytes())
        return self.tvm.runtime.load_module(str(self.bundle / job["library"]))

    def check(self, module, job: dict) -> str | None:
        """None if the job's output on its check shape matches the bundle's, else what is wrong."""
        np = self.np
        expected = np.load(self.bundle / job["check"])
        rng = np.random.default_rng(job["check_seed"])  # drawn as the bundle's exporter drew them
        drawn = [rng.uniform(-1, 1, s).astype("float32") for s in job["check_inputs"]]
        if not np.allclose([x.sum(dtype=np.float64) for x in drawn], job["check_sums"], rtol=1e-6):
            return "this host's numpy draws other check inputs than the exporter's: cannot check"
        inputs = [self.tvm.runtime.tensor(x, self.device) for x in drawn]
        output = self.tvm.runtime.tensor(np.full(expected.shape, np.nan, "float32"), self.device)
        module["main"](*call_arguments(inputs, output, job["check_scalars"]))
        got = output.numpy()
        tolerance = job.get("tolerance", CHECK_TOLERANCE)
        if np.allclose(got, expected, rtol=tolerance, atol=tolerance):
            return None
        worst = float(np.nanmax(np.abs(got - expected))) if np.isfinite(got).any() else float("nan")
        return f"wrong result on {job['check_shape']}: max abs error {worst:.3g}"

    def time(self, module, shape: dict) -> float:
        np = self.np
        rng = np.random.default_rng(0)
        inputs = [self.tvm.runtime.tensor(rng.uniform(-1, 1, s).astype("float32"), self.device)
                  for s in shape["inputs"]]
        output = self.tvm.runtime.empty(shape["output"], "float32", self.device)
        arguments = call_arguments(inputs, output, shape["scalars"])
        timer = module.time_evaluator("main", self.device, number=1, repeat=1)
        module["main"](*arguments)  # warm: the module's first call loads its kernels
        samples = []
        for _ in range(self.repeat):
            self._scratch.copyfrom(self._zeros)  # evicts the operands from L2
            samples.append(timer(*arguments).mean)
        return float(np.median(samples))


def measure(gpu: Gpu, job: dict) -> dict:
    """One job's result line; a failing job is a result, not a crash."""
    result = {"job": job["id"], "device": gpu.name}
    try:
        module = gpu.load(job)
        error = gpu.check(module, job)
        if error is None:
            result["latencies_s"] = [gpu.time(module, shape) for shape in job["shapes"]]
        else:
            result["error"] = error
    except Exception as err:  # noqa: BLE001 - reported per job
        result["error"] = f"{type(err).__name__}: {err}"[:2000]
    return result


def read_results(results: Path) -> tuple[dict[str, dict], str | None]:
    """(each job's result line, the job a dead child started without finishing, if any)."""
    answers, started = {}, None
    if results.exists():
        for line in results.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if entry.get("started"):
                started = entry["job"]
            else:
                answers[entry["job"]] = entry
    return answers, (started if started not in answers else None)


def append(results: Path, entry: dict) -> None:
    with open(results, "a") as stream:
        stream.write(json.dumps(entry) + "\n")
        stream.flush()
        os.fsync(stream.fileno())


def run_jobs(bundle: Path, out: Path, measure_job=None, repeat: int = 9) -> None:
    """Measures every job without a result in ``out``, marking each as started first."""
    jobs = json.loads((bundle / "bundle.json").read_text())["jobs"]
    results = out / RESULTS
    done, _ = read_results(results)
    if measure_job is None:
        gpu = Gpu(bundle, repeat)
        measure_job = lambda job: measure(gpu, job)  # noqa: E731
    for job in jobs:
        if job["id"] in done:
            continue
        append(results, {"job": job["id"], "started": True})
        entry = measure_job(job)
        append(results, entry)
        print(json.dumps(entry), flush=True)


def supervise(bundle: Path, out: Path, repeat: int) -> int:
    """Children measure until every job has a result; a job a child died in is recorded failed."""
    total = len(json.loads((bundle / "bundle.json").read_text())["jobs"])
    results = out / RESULTS
    while True:
        child = subprocess.run([sys.executable, __file__, "--bundle", str(bundle), "--out", str(out),
                                "--repeat", str(repeat), "--child"])
        done, died_in = read_results(results)
        if died_in is not None:
            append(results, {"job": died_in, "error": f"the measuring process died (exit {child.returncode})"})
            continue
        if len(done) >= total or child.returncode == 0:
            print(f"{len(done)} of {total} jobs measured: {results}", flush=True)
            return 0 if len(done) >= total else 1
        print(f"the measuring process failed (exit {child.returncode}) outside any job", flush=True)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure a dietserve tuning bundle on this GPU.")
    parser.add_argument("--bundle", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--out", type=Path, required=True, help="folder for results.jsonl (kept across reruns)")
    parser.add_argument("--repeat", type=int, default=9, help="single timed calls per shape (median kept)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    bootstrap(args.bundle)
    if args.child:
        run_jobs(args.bundle, args.out, repeat=args.repeat)
        return 0
    return supervise(args.bundle, args.out, args.repeat)


if __name__ == "__main__":
    sys.exit(main())
