"""Why an artifact runs what it runs: per dynamic operator, the kernel variant its decision tree
picks at one (batch, seq_len), that micro-kernel's padding waste, and what the tuning plan knows
about its latency there (measured, the tuner's prediction, or scaled from the nearest tuned
shape); for a packed artifact, the attention kernel's tile at that sequence length. Pure Python:
reads manifest.json and plans/, needs no TVM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .host.hardware import detect_cpu
from .kernels.cpu_packed.kernel import computed_extent
from .kernels.cpu_varlen.tile import LENGTH_VAR, tile_for
from .kernels.plan.attention_plan import ATTENTION_SUFFIX, read_attention_plans
from .kernels.plan.decision_tree import TreeError, choose, evaluate_text
from .kernels.plan.kernel_plan import DEFAULT_VARIANT, KernelPlan, read_plans
from .kernels.plan.microkernel import MicroKernel
from .model.config import BertConfig
from .runtime.manifest import LAYOUT_PACKED, PLANS_DIR, Manifest
from .runtime.variant_by_shape import dispatch_shape

DEFAULT_KERNEL_TEXT = "default rule"
_SHADES = ("C2", "C1", "C4", "C8", "C9", "C5", "C6", "C7")  # C0 and C3 draw the curves


@dataclass(frozen=True)
class ExplainRow:
    operator: str  # PrimFunc name (the manifest's dispatch key)
    tuned_as: str | None  # the operator's name in the plan, None without a plan
    workload: str
    calls: int  # executions per model run (call sites)
    variant: str  # what the manifest's tree picks at this shape
    kernel: str  # str(MicroKernel), or "default rule"
    quantity: str | None  # the dispatch quantity's shape text, e.g. "batch * seq_len"
    value: int | None  # the quantity at this shape
    waste_i_pct: float | None  # padded rows along axis i, percent of the padded extent
    waste_j_pct: float | None
    latency_s: float | None  # one execution of the chosen variant
    source: str | None  # "measured", "predicted" or "extrapolated" (beyond the tuned range)
    default_latency_s: float | None  # the untuned kernel at this shape
    default_source: str | None
    gflops: float | None
    note: str = ""  # why something is unknown


@dataclass(frozen=True)
class _Point:
    shape: dict
    value: int
    latency_s: float
    measured: bool


def explain_rows(directory: Path, batch: int, seq_len: int) -> list[ExplainRow]:
    """One row per dispatched operator of the artifact in ``directory`` at (batch, seq_len)."""
    manifest = Manifest.read(Path(directory))
    for name, value in (("batch", batch), ("seq_len", seq_len)):
        bound = manifest.bounds.get(name)
        if value < 1 or (bound is not None and value > int(bound)):
            raise ValueError(f"{name}={value} is outside this artifact's range 1..{bound}")
    shape = dispatch_shape(batch, seq_len)
    return [_row(name, entry, plan, note, shape) for name, entry, plan, note in _linked(Path(directory), manifest)]


def format_explain(rows: list[ExplainRow], batch: int, seq_len: int) -> str:
    """A fixed-width table, one line per operator, and the total over a model run."""
    header = ("operator", "calls", "variant", "value", "pad i%", "pad j%", "latency ms", "source",
              "default ms", "speedup", "GFLOP/s", "kernel")
    table = [header]
    for row in rows:
        speedup = (row.default_latency_s / row.latency_s
                   if row.latency_s is not None and row.default_latency_s is not None else None)
        table.append((row.operator, str(row.calls), row.variant, _text(row.value), _text(row.waste_i_pct, "{:.1f}"),
                      _text(row.waste_j_pct, "{:.1f}"), _text(_ms(row.latency_s), "{:.4f}"), row.source or "-",
                      _text(_ms(row.default_latency_s), "{:.4f}"), _text(speedup, "{:.2f}x"),
                      _text(row.gflops, "{:.1f}"), row.kernel + (f"  ({row.note})" if row.note else "")))
    widths = [max(len(line[col]) for line in table) for col in range(len(header) - 1)]
    lines = [f"kernel dispatch at batch={batch} seq_len={seq_len} ({len(rows)} dynamic operators)"]
    for line in table:
        cells = [cell.ljust(width) if col in (0, 2, 7) else cell.rjust(width)
                 for col, (cell, width) in enumerate(zip(line, widths, strict=False))]
        lines.append("  ".join([*cells, line[-1]]).rstrip())
    lines.append(_total("tuned", [(r.latency_s, r.calls) for r in rows]))
    lines.append(_total("default", [(r.default_latency_s, r.calls) for r in rows]))
    lines.append("latency per execution; measured: timed when tuning; predicted: the tuner's model or the nearest "
                 "tuned shape's throughput; extrapolated: beyond the tuned range; -: unknown")
    return "\n".join(lines)


def explain_attention(directory: Path, seq_len: int) -> str | None:
    """The packed attention kernel's tile for a sequence of ``seq_len`` tokens (each sequence of a
    batch takes the branch of its own length), and what tuning timed there; None for a padded
    artifact, whose attention is two dispatched products like any other."""
    manifest = Manifest.read(Path(directory))
    if manifest.layout != LAYOUT_PACKED:
        return None
    config = BertConfig(**manifest.model_config)
    heads, head_dim = config.num_attention_heads, config.head_dim
    lines = [f"attention: the packed kernel, {heads} heads of {head_dim}, each sequence by its own length "
             f"({manifest.precision} build)"]
    plans = read_attention_plans(sorted((Path(directory) / PLANS_DIR).glob("*" + ATTENTION_SUFFIX)))
    if not plans:
        tile = tile_for(detect_cpu(set(manifest.required_cpu_flags)))
        lines.append(f"  length {seq_len} -> {tile.describe()}: no attention plan, the tile the CPU's registers fit")
        return "\n".join(lines)
    plan = plans[0]
    name = choose(plan.tree, {LENGTH_VAR: seq_len})
    lines.append(f"  length {seq_len} -> {name}: attention plan, {len(plan.tiles)} tile(s) over lengths "
                 f"({plan.provenance.get('weights', 'unknown')} weights)")
    group = next((entry for entry in plan.lengths if seq_len <= entry["up_to"]), None)
    if group is not None:
        default = group.get("default_latency_s")
        lines.append(f"  timed at length {group['length']} (lengths up to {group['up_to']}): "
                     f"{group['latency_s'] * 1e3:.4f} ms a sequence, the CPU's tile "
                     f"{'-' if default is None else f'{default * 1e3:.4f} ms'}")
    return "\n".join(lines)


def write_explain_plot(directory: Path, path: Path, batch: int = 1) -> Path:
    """PNG: per operator with a plan, latency and GFLOP/s of the dispatched variants and of the
    untuned kernel over the plan's shapes, each variant's interval shaded; ``batch`` labels a
    second x axis in seq_len at that batch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    directory = Path(directory)
    if not (directory / PLANS_DIR).is_dir():
        raise ValueError(f"{directory} holds no {PLANS_DIR}/ folder: built without tuned plans, nothing to plot")
    linked = [(name, entry, plan) for name, entry, plan, _ in _linked(directory, Manifest.read(directory))
              if plan is not None and plan.shapes]
    if not linked:
        raise ValueError(f"no operator of {directory} runs a tuned plan with shape data: nothing to plot")
    # A private Figure on the Agg canvas: no pyplot global state, no backend switch for the caller.
    figure = Figure(figsize=(13, 4.8 * len(linked)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(linked), 2, squeeze=False)
    for (name, entry, plan), (left, right) in zip(linked, axes, strict=True):
        _plot_operator(left, right, name, entry, plan, batch)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    figure.savefig(temporary, format="png", dpi=110)
    temporary.replace(path)
    return path


def _linked(directory: Path, manifest: Manifest) -> list[tuple[str, dict, KernelPlan | None, str]]:
    """(name, dispatch entry, plan or None, note) per operator; a plan only where the entry was
    linked to one and the file in plans/ is that very plan."""
    plans_dir = directory / PLANS_DIR
    plans = {plan.workload: plan for plan in read_plans([plans_dir])} if plans_dir.is_dir() else {}
    linked = []
    for name, entry in manifest.dispatch.items():
        plan, note = plans.get(entry.get("workload")), ""
        if entry.get("plan") is None:
            plan = None  # compiled untuned: a plan file for the workload does not describe this kernel
        elif plan is None:
            note = f"plan {str(entry['plan'])[:12]} not in {PLANS_DIR}/"
        elif plan.digest() != entry["plan"]:
            plan, note = None, f"{PLANS_DIR}/ holds another plan than the one linked"
        linked.append((name, entry, plan, note))
    return linked


def _row(name: str, entry: dict, plan: KernelPlan | None, note: str, shape: dict) -> ExplainRow:
    variant = choose(entry["tree"], shape)
    kernel = None if plan is None or variant not in plan.variants else plan.kernel(variant)
    extents = _extents(plan, shape)
    value = _evaluate(plan.tuned_range.get("var"), shape) if plan is not None else None
    latency = default = (None, None)
    if plan is not None:
        default = _estimate(plan, _default_points(plan), shape, value)
        latency = default if variant == DEFAULT_VARIANT else _estimate(plan, _variant_points(plan, variant), shape,
                                                                       value)
    flops = _flops(extents)
    return ExplainRow(
        operator=name, tuned_as=plan.operator if plan is not None else entry.get("operator"),
        workload=str(entry.get("workload", "")), calls=int(entry.get("calls", 1)), variant=variant,
        kernel=DEFAULT_KERNEL_TEXT if kernel is None else str(kernel),
        quantity=plan.tuned_range.get("var") if plan is not None else None, value=value,
        waste_i_pct=_waste(kernel, extents, "i"), waste_j_pct=_waste(kernel, extents, "j"),
        latency_s=latency[0], source=latency[1], default_latency_s=default[0], default_source=default[1],
        gflops=flops / latency[0] / 1e9 if flops is not None and latency[0] else None, note=note)


def _evaluate(text: str | None, shape: dict) -> int | None:
    if text is None:
        return None
    try:
        return int(evaluate_text(text, shape))
    except TreeError:
        return None


def _extents(plan: KernelPlan | None, shape: dict) -> dict[str, int] | None:
    if plan is None:
        return None
    extents = {axis: _evaluate(text, shape) for axis, text in plan.axes.items()}
    return None if any(value is None for value in extents.values()) else extents


def _flops(extents: dict[str, int] | None) -> int | None:
    if extents is None or not {"i", "j", "k"} <= set(extents):
        return None
    return 2 * extents.get("b", 1) * extents["i"] * extents["j"] * extents["k"]


def _waste(kernel: MicroKernel | None, extents: dict[str, int] | None, axis: str) -> float | None:
    if kernel is None or extents is None or axis not in extents or extents[axis] < 1:
        return None
    try:
        computed = computed_extent(kernel, axis, extents[axis])
    except KeyError:
        return None
    return 100.0 * (1.0 - extents[axis] / computed)


def _usable(latency: object) -> bool:
    return isinstance(latency, int | float) and math.isfinite(latency) and latency > 0


def _variant_points(plan: KernelPlan, variant: str) -> list[_Point]:
    # A row records the latency of the variant chosen there only, so only those rows speak for it.
    return [_Point(row["shape"], row["value"], float(row["latency_s"]), bool(row.get("measured")))
            for row in plan.shapes if row.get("variant") == variant and _usable(row.get("latency_s"))]


def _default_points(plan: KernelPlan) -> list[_Point]:
    return [_Point(row["shape"], row["value"], float(row["default_latency_s"]), bool(row.get("default_measured")))
            for row in plan.shapes if _usable(row.get("default_latency_s"))]


def _estimate(plan: KernelPlan, points: list[_Point], shape: dict,
              value: int | None) -> tuple[float | None, str | None]:
    """Latency at ``shape`` from the plan's points: a point computing the same extents stands as
    recorded; otherwise the nearest point's throughput (flops per second) carries over."""
    if not points or value is None:
        return None, None
    extents = _extents(plan, shape)
    for point in points:
        same = (_extents(plan, point.shape) == extents) if extents is not None else point.value == value
        if same:
            return point.latency_s, "measured" if point.measured else "predicted"
    nearest = min(points, key=lambda p: (abs(p.value - value), p.value))
    flops, nearest_flops = _flops(extents), _flops(_extents(plan, nearest.shape))
    if flops and nearest_flops:
        scale = flops / nearest_flops
    elif nearest.value > 0:
        scale = value / nearest.value
    else:
        return None, None
    low, high = plan.tuned_range.get("min"), plan.tuned_range.get("max")
    beyond = (low is not None and value < low) or (high is not None and value > high)
    return nearest.latency_s * scale, "extrapolated" if beyond else "predicted"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _text(value: object, pattern: str = "{}") -> str:
    return "-" if value is None else pattern.format(value)


def _total(label: str, items: list[tuple[float | None, int]]) -> str:
    known = [(latency, calls) for latency, calls in items if latency is not None]
    if not known:
        return f"total {label}: - (no latency data)"
    total = sum(latency * calls for latency, calls in known)
    missing = len(items) - len(known)
    unknown = f", {missing} operator(s) without data not counted" if missing else ""
    return f"total {label}: {total * 1e3:.4f} ms per run (latency x calls over {len(known)} operator(s){unknown})"


def _plot_operator(left, right, name: str, entry: dict, plan: KernelPlan, batch: int) -> None:
    rows = sorted(plan.shapes, key=lambda row: row["value"])
    values = [row["value"] for row in rows]
    low, high = min(values), max(values)
    logarithmic = low >= 1 and high / low >= 8
    lo_edge, hi_edge = (low / 1.3, high * 1.3) if logarithmic else (low - 0.5, high + 0.5)
    colours = {}
    for ax in (left, right):
        if logarithmic:
            ax.set_xscale("log", base=2)
            _plain_ticks(ax.xaxis)
        ax.set_xlim(lo_edge, hi_edge)
        _shade_variants(ax, plan, rows, lo_edge, hi_edge, colours, labelled=ax is left)
    tuned = [(row["value"], row.get("latency_s"), bool(row.get("measured")), row["shape"]) for row in rows]
    untuned = [(row["value"], row.get("default_latency_s"), bool(row.get("default_measured")), row["shape"])
               for row in rows]
    for series, label, style, colour in ((tuned, "dispatched variant", "-", "C0"),
                                         (untuned, "default (untuned) kernel", "--", "C3")):
        points = [(v, lat, measured, shape) for v, lat, measured, shape in series if _usable(lat)]
        if not points:
            continue
        rates = [(v, _flops(_extents(plan, shape)), lat, measured) for v, lat, measured, shape in points]
        rates = [(v, flops / lat / 1e9, measured) for v, flops, lat, measured in rates if flops]
        for ax, data in ((left, [(v, lat * 1e3, m) for v, lat, m, _ in points]), (right, rates)):
            if not data:
                continue
            ax.plot([d[0] for d in data], [d[1] for d in data], style, color=colour, linewidth=0.9, label=label)
            measured = [d for d in data if d[2]]
            if measured:
                ax.plot([d[0] for d in measured], [d[1] for d in measured], "o", color=colour, markersize=4,
                        linestyle="none", label=f"{label}: measured")
    quantity = plan.tuned_range.get("var", "value")
    # Shapes hold other vars constant (the tuner fixes them): the curve is only valid there.
    constant = sorted((k, v) for k, v in rows[0]["shape"].items() if all(r["shape"].get(k) == v for r in rows))
    at = f"; shapes at {', '.join(f'{k}={v}' for k, v in constant)}" if len(constant) < len(rows[0]["shape"]) else ""
    latencies = [y for line in left.lines for y in line.get_ydata()]
    if latencies and max(latencies) / min(latencies) >= 8:
        left.set_yscale("log")  # latency spans decades over the range: small shapes stay readable
    left.set_title(f"{name} ({plan.operator}), {entry.get('calls', 1)} calls{at}\n"
                   "markers: measured, line alone: predicted", fontsize=9)
    right.set_title(f"{name}: GFLOP/s = 2*b*i*j*k / latency", fontsize=9)
    for ax, what in ((left, "latency per execution (ms)"), (right, "GFLOP/s")):
        ax.set_xlabel(f"dispatch quantity: {quantity}", fontsize=8)
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
        _seq_axis(ax, quantity, batch, logarithmic)
    # Below the panels, where no curve can hide under them: variants on the left, curves on the right.
    spans = [patch for patch in left.patches if not patch.get_label().startswith("_")]
    left.legend(handles=spans, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    if right.lines:
        right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    else:
        right.text(0.5, 0.5, "no matmul axes to count flops", transform=right.transAxes, ha="center")


def _shade_variants(ax, plan: KernelPlan, rows: list[dict], lo_edge: float, hi_edge: float, colours: dict,
                    labelled: bool) -> None:
    """The tree sends a value to the first run whose last value is not below it: each run spans
    (previous run's last value, its own last value]; the ends stretch to the axis edges."""
    runs: list[list] = []  # [variant, last value]
    for row in rows:
        if runs and runs[-1][0] == row["variant"]:
            runs[-1][1] = row["value"]
        else:
            runs.append([row["variant"], row["value"]])
    start = lo_edge
    for index, (variant, last) in enumerate(runs):
        end = hi_edge if index == len(runs) - 1 else last
        colour = colours.setdefault(variant, _SHADES[len(colours) % len(_SHADES)])
        kernel = plan.kernel(variant) if variant in plan.variants else None
        label = f"{variant}: {DEFAULT_KERNEL_TEXT if kernel is None else kernel}"
        shown = not labelled or any(patch.get_label() == label for patch in ax.patches)
        ax.axvspan(start, end, color=colour, alpha=0.12, label="_nolegend_" if shown else label)
        start = end


def _seq_axis(ax, quantity: str, batch: int, logarithmic: bool) -> None:
    """A top axis in seq_len at ``batch`` where the quantity is linear in seq_len (it is for the
    row counts dispatch keys on: seq_len, batch * seq_len)."""
    at = [_evaluate(quantity, dispatch_shape(batch, s)) for s in (1, 2, 3)]
    if None in at:
        return
    slope, offset = at[1] - at[0], 2 * at[0] - at[1]
    if slope <= 0 or at[2] != offset + 3 * slope or (slope, offset) == (1, 0):
        return  # not linear, or the quantity is seq_len itself: the bottom axis already says it
    top = ax.secondary_xaxis("top", functions=(lambda v: (v - offset) / slope, lambda s: s * slope + offset))
    top.set_xlabel(f"seq_len at batch={batch}", fontsize=8)
    if logarithmic:
        _plain_ticks(top.xaxis)


def _plain_ticks(axis) -> None:
    """Powers of two written as numbers: shapes are read as 64, 128, not 2^6 or 10^2."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=2))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}" if v >= 1 else ""))
    axis.set_minor_formatter(NullFormatter())
