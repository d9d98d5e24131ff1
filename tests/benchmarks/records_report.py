"""A tuner records database summarised: per workload, a per-shape table of the best latency and a
plot of latency against the shape var (``dietserve explain`` reads plans; this reads records).

    python tests/benchmarks/records_report.py --db records.jsonl [--workload W] [--plot latency.png]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dietserve.kernels.plan.kernel_plan import DEFAULT_VARIANT  # noqa: E402
from dietserve.kernels.plan.microkernel import MicroKernel  # noqa: E402
from tuner.database.records import RecordDatabase, TuningRecord, fastest_per_shape  # noqa: E402


def workloads(records: list[TuningRecord]) -> list[tuple[str, str]]:
    return sorted({(r.workload, r.target) for r in records})


def best_rows(records: list[TuningRecord], workload: str, target: str) -> list[tuple[dict, TuningRecord, int]]:
    """(shape, fastest record, kernels measured there) per measured shape, by shape."""
    ok = [r for r in records if r.workload == workload and r.target == target and r.ok]
    best, counts = fastest_per_shape(ok), Counter(r.shape_key() for r in ok)
    return [(dict(key), best[key], counts[key]) for key in sorted(best)]


def format_table(records: list[TuningRecord], workload: str, target: str) -> str:
    rows = best_rows(records, workload, target)
    failed = sum(1 for r in records if r.workload == workload and r.target == target and not r.ok)
    lines = [f"{workload} on {target}: {len(rows)} shapes measured, {failed} failed candidates",
             f"{'shape':>14} {'best latency':>13} {'GFLOP/s':>8} {'tried':>6}  kernel"]
    for shape, record, count in rows:
        shape_text = ",".join(f"{k}={v}" for k, v in sorted(shape.items()))
        flops = record.meta.get("flops")
        rate = f"{flops / record.latency_s / 1e9:8.1f}" if flops else f"{'-':>8}"
        lines.append(f"{shape_text:>14} {record.latency_s * 1e3:10.3f} ms {rate} {count:6d}  "
                     f"{_kernel_text(record.kernel)}")
    return "\n".join(lines)


def write_plot(records: list[TuningRecord], workload: str, target: str, path: Path) -> Path:
    """PNG: best measured latency per shape vs the varying shape var (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = best_rows(records, workload, target)
    if not rows:
        raise ValueError(f"no successful measurements of {workload} on {target} to plot")
    var = _varying(rows)
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([shape[var] for shape, _, _ in rows], [record.latency_s * 1e3 for _, record, _ in rows],
              marker="o", markersize=3, linewidth=1)
    axis.set_xlabel(var)
    axis.set_ylabel("best latency (ms)")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.grid(True, which="both", alpha=0.3)
    axis.set_title(f"{workload}\n{target}", fontsize=9)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    figure.savefig(temporary, format="png", dpi=120)
    plt.close(figure)
    temporary.replace(path)
    return path


def _varying(rows) -> str:
    names = sorted(rows[0][0])
    for name in names:
        if len({shape[name] for shape, _, _ in rows}) > 1:
            return name
    return names[0]


def _kernel_text(kernel: str) -> str:
    return "default rule (untuned)" if kernel == DEFAULT_VARIANT else str(MicroKernel.from_json(kernel))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--workload", help="only this workload (default: every one in the database)")
    parser.add_argument("--plot", help="PNG path (default: DB with .png)")
    args = parser.parse_args(argv)
    database = RecordDatabase(Path(args.db))
    if not database.path.exists():
        raise SystemExit(f"no records database at {database.path}")
    records = list(database.records())
    found = [(w, t) for w, t in workloads(records) if args.workload in (None, w)]
    if not found:
        raise SystemExit(f"{database.path} has no records{' for ' + args.workload if args.workload else ''}")
    for index, (workload, target) in enumerate(found):
        print(format_table(records, workload, target), end="\n\n")
        plot = Path(args.plot) if args.plot else database.path.with_suffix(".png")
        if len(found) > 1:
            plot = plot.with_name(f"{plot.stem}-{index}{plot.suffix}")
        try:
            print(f"plot of {workload}: {write_plot(records, workload, target, plot)}", file=sys.stderr)
        except ValueError as err:
            print(err, file=sys.stderr)
    if database.skipped_lines:
        print(f"skipped {database.skipped_lines} unreadable line(s) (a truncated write)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
