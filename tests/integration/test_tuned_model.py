"""Tuned kernels in the served model: `dietserve tune` end to end, plans linked into BERT and
checked against transformers, the compiled decision tree against the server's mirror, bad plans
refused, and a server reporting more than one variant. Most tests build the padded layout (the
graph CUDA builds), whose attention products take linked kernels too; the packed layout, the CPU
default, links plans over its tokens (``test_linked_variants_in_the_packed_layout_...``)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
import tvm
from tvm import tirx

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.compile.passes.fuse_softmax import FUSED_SUFFIX
from dietserve.compile.tuning import tuning_tasks
from dietserve.host.cpu import cpu_flags
from dietserve.host.hardware import detect_cpu
from dietserve.kernels.cpu_varlen.tile import VarlenTile
from dietserve.kernels.decision_tree_func import lower_tree
from dietserve.kernels.plan.attention_plan import AttentionPlan, attention_plan_path
from dietserve.kernels.plan.decision_tree import choose, interval_tree, thresholds
from dietserve.kernels.plan.kernel_plan import DEFAULT_VARIANT, KernelPlan, PlanError, plan_path
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.model.bert import PACKED_VARS, SHAPE_VARS
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine
from dietserve.runtime.manifest import LAYOUT_PACKED, LAYOUT_PADDED, Manifest
from dietserve.runtime.variant_by_shape import KernelDispatch

from .conftest import MAX_BATCH, resident_growth_of_load
from .reference import as_layout_answers, padded_batch, reference_hidden
from .scrape import metrics_after_batches
from .server_process import ServerProcess

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4
LANES = detect_cpu(cpu_flags() or set()).lanes()


def micro(mr: int, ti: int, vectors: int, tj: int) -> dict:
    return MicroKernel(tile=(("i", (mr, ti)), ("j", (vectors * LANES, tj)), ("k", (1,))), vector=LANES).to_dict()


# Three variants besides the default rule, split at row counts 3 | 40 | 200 (boundaries probed below).
VARIANTS = {"v0": micro(1, 1, 2, 2), "v1": micro(4, 2, 2, 1), "v2": micro(6, 4, 2, 2), DEFAULT_VARIANT: None}


def clamped(mr: int, ti: int, vectors: int, panel: bool) -> dict:
    return MicroKernel(tile=(("i", (mr, ti)), ("j", (vectors * LANES,)), ("k", (1,))), vector=LANES,
                       cache_scopes=("clamped", "B.local") if panel else ("clamped",)).to_dict()


# Attention's products (no weight) get clamped-tile kernels, as the tuner's space gives them.
CLAMPED_VARIANTS = {"v0": clamped(1, 1, 1, False), "v1": clamped(4, 8, 3, True), "v2": clamped(6, 8, 2, False),
                    DEFAULT_VARIANT: None}
SPLITS = [(3, "v0"), (40, "v1"), (200, DEFAULT_VARIANT), (4096, "v2")]


def handmade_plan(task, target: dict, shape_vars=SHAPE_VARS) -> KernelPlan:
    """A plan as the tuner writes one, with several variants, for one of the model's operators."""
    from dietserve.kernels.cpu_clamped.kernel import clamped_fits
    from dietserve.kernels.cpu_packed.packing import weight_param
    from dietserve.kernels.tir.matching import matmul_axes

    func = tvm.ir.load_json(task.func)
    axes = matmul_axes(func)
    values = [value for value, _ in SPLITS]
    attention = weight_param(func) is None and all(
        clamped_fits(func, MicroKernel.from_dict(k)) for k in CLAMPED_VARIANTS.values() if k)
    return KernelPlan(workload=task.workload, operator=task.operator, shape_vars=list(shape_vars), axes=axes,
                      target=target, tvm_version=str(tvm.__version__),
                      variants=CLAMPED_VARIANTS if attention else VARIANTS,
                      tree=interval_tree(axes["i"], values, [name for _, name in SPLITS]),
                      tuned_range={"var": axes["i"], "min": 1, "max": 512}, provenance={"model": {"name": "test"}})


@pytest.fixture(scope="module")
def minilm_tasks(cache_dir: Path):
    return tuning_tasks(CompileRequest(model="default", max_batch=MAX_BATCH, layout=LAYOUT_PADDED), cache_dir)


@pytest.fixture(scope="module")
def handmade_plans(minilm_tasks, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("plans")
    for task in minilm_tasks.tasks:
        handmade_plan(task, minilm_tasks.target).write(plan_path(folder, task.workload))
    return folder


@pytest.fixture(scope="module")
def linked_artifact(handmade_plans: Path, cache_dir: Path) -> Path:
    return compile_artifact(CompileRequest(model="default", max_batch=MAX_BATCH, plans=(handmade_plans,),
                                           layout=LAYOUT_PADDED), cache_dir)


@pytest.fixture(scope="module")
def linked_engine(linked_artifact: Path) -> Engine:
    return Engine(load_artifact(linked_artifact))


def _check(engine: Engine, reference, batch: int, seq: int) -> None:
    ids, mask, types = padded_batch(np.random.default_rng(batch * 1000 + seq), batch, seq, engine.vocab_size)
    expected = as_layout_answers(engine, reference_hidden(reference, ids, mask, types), mask)
    error = float(np.abs(engine.run(ids, mask, types).last_hidden_state - expected).max())
    assert error <= TOLERANCE, f"batch={batch} seq={seq}: max abs error {error:.2e}"


@pytest.mark.parametrize("batch, seq", [(1, 1), (1, 3), (1, 4), (3, 13), (1, 40), (1, 41), (2, 100), (1, 201),
                                        (1, 300), (8, 64)])
def test_linked_variants_match_transformers_on_both_sides_of_each_split(linked_engine, minilm_reference, batch, seq):
    _check(linked_engine, minilm_reference, batch, seq)


# The attention kernel's tiles, split at sequence lengths 3 | 60 (a one-row tile for the shortest).
ATTENTION_TILES = {"row": VarlenTile(mr=1, nr=LANES, nc=LANES, lanes=LANES),
                   "mid": VarlenTile(mr=3, nr=2 * LANES, nc=LANES, lanes=LANES),
                   "long": VarlenTile(mr=4, nr=2 * LANES, nc=2 * LANES, lanes=LANES)}


@pytest.fixture(scope="module")
def linked_packed_engine(cache_dir: Path, tmp_path_factory) -> Engine:
    """MiniLM in the packed layout with the handmade plans over its tokens, and an attention plan
    whose tree picks a tile by each sequence's length."""
    request = CompileRequest(model="default", max_batch=MAX_BATCH, layout=LAYOUT_PACKED)
    tasks = tuning_tasks(request, cache_dir)
    assert sum(task.vary["var"] == "tokens" for task in tasks.tasks) == 4  # the dense layers (and the pooling)
    assert (tasks.attention.heads, tasks.attention.head_dim, tasks.attention.max_len) == (12, 32, 512)
    folder = tmp_path_factory.mktemp("packed-layout-plans")
    for task in tasks.tasks:
        handmade_plan(task, tasks.target, (*SHAPE_VARS, *PACKED_VARS)).write(plan_path(folder, task.workload))
    attention = AttentionPlan(heads=12, head_dim=32, target=tasks.target, tvm_version=str(tvm.__version__),
                              tiles={name: tile.to_dict() for name, tile in ATTENTION_TILES.items()},
                              tree=interval_tree("length", [3, 60, 512], ["row", "mid", "long"]))
    attention.write(attention_plan_path(folder, 12, 32))
    artifact = compile_artifact(dataclasses.replace(request, plans=(folder,)), cache_dir)
    dense = [entry for entry in Manifest.read(artifact).dispatch.values() if entry["tree"].get("var") == "tokens"]
    assert len(dense) == 4 and all(sorted(entry["variants"]) == sorted(VARIANTS) for entry in dense)
    assert AttentionPlan.read(attention_plan_path(artifact / "plans", 12, 32)) == attention
    return Engine(load_artifact(artifact))


@pytest.mark.parametrize("batch, seq", [(1, 1), (1, 3), (1, 4), (3, 13), (1, 41), (2, 100), (1, 201), (8, 64)])
def test_linked_variants_in_the_packed_layout_match_transformers(linked_packed_engine, minilm_reference, batch,
                                                                 seq) -> None:
    """The trees dispatch on the batch's attended tokens: a padded batch's T falls on either side
    of the splits at 3, 40 and 200 as its mask has it; its sequences on either side of the
    attention tree's splits at 3 and 60."""
    _check(linked_packed_engine, minilm_reference, batch, seq)


def test_odd_sized_bert_with_linked_variants_matches_transformers(tmp_path: Path, cache_dir: Path) -> None:
    """Hidden 48, intermediate 80, 4 heads of 12: no column count is a whole number of tiles."""
    from dietserve.model.config import BertConfig
    from dietserve.model.presets import materialize_random_bert

    from .reference import reference_model

    config = BertConfig(vocab_size=500, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=80, hidden_act="gelu", max_position_embeddings=256, type_vocab_size=2)
    folder = materialize_random_bert(config, tmp_path / "odd-bert", seed=5, std=0.3)
    request = CompileRequest(model=str(folder), max_batch=4, layout=LAYOUT_PADDED)
    tasks = tuning_tasks(request, cache_dir)
    for task in tasks.tasks:
        handmade_plan(task, tasks.target).write(plan_path(tmp_path / "plans", task.workload))
    artifact = compile_artifact(dataclasses.replace(request, plans=(tmp_path / "plans",)), cache_dir)
    assert any(len(e["variants"]) > 1 for e in Manifest.read(artifact).dispatch.values())
    engine, reference = Engine(load_artifact(artifact)), reference_model(folder)
    for batch, seq in ((1, 1), (1, 3), (2, 21), (1, 41), (4, 55), (1, 211)):
        _check(engine, reference, batch, seq)


def packed(mr: int, panel_vectors: int, pk: int, groups: int) -> dict:
    panel = panel_vectors * LANES
    return MicroKernel(tile=(("i", (mr,)), ("j", (panel, pk, groups)), ("k", (1,))), vector=LANES,
                       pack=panel).to_dict()


# Packed-weight GEMM kernels: the small-T regime (one row, 4 panels per register tile) and two
# 2-D tilings, all reading the weight in panels of 3 vectors, split at row counts 2 | 60.
PACKED_VARIANTS = {"stream": packed(1, 3, 4, 1), "tile4": packed(4, 3, 1, 2), "tile2": packed(2, 3, 2, 1)}
PACKED_SPLITS = [(2, "stream"), (60, "tile2"), (4096, "tile4")]


@pytest.fixture(scope="module")
def packed_artifact(minilm_tasks, tmp_path_factory, cache_dir: Path) -> Path:
    """MiniLM with packed-weight kernels in its four dense layers, split at row counts 2 | 60."""
    from dietserve.kernels.cpu_packed.packing import weight_param
    from dietserve.kernels.tir.matching import matmul_axes

    folder = tmp_path_factory.mktemp("packed-plans")
    dense = [task for task in minilm_tasks.tasks if weight_param(tvm.ir.load_json(task.func)) is not None]
    assert len(dense) == 4  # q/k/v, attention output, intermediate, output
    for task in dense:
        axes = matmul_axes(tvm.ir.load_json(task.func))
        KernelPlan(workload=task.workload, operator=task.operator, shape_vars=["batch", "seq_len"], axes=axes,
                   target=minilm_tasks.target, tvm_version=str(tvm.__version__), variants=PACKED_VARIANTS,
                   tree=interval_tree(axes["i"], [v for v, _ in PACKED_SPLITS], [n for _, n in PACKED_SPLITS]),
                   tuned_range={"var": axes["i"], "min": 1, "max": 512},
                   provenance={"model": {"name": "test"}}).write(plan_path(folder, task.workload))
    return compile_artifact(CompileRequest(model="default", max_batch=MAX_BATCH, plans=(folder,), layout=LAYOUT_PADDED),
                            cache_dir)


def test_packed_weight_kernels_match_transformers_and_pack_once_at_load(packed_artifact: Path,
                                                                       minilm_reference) -> None:
    manifest = Manifest.read(packed_artifact)
    assert manifest.transform_params == "forward_transform_params"
    panels = {entry["packed_panel"] for entry in manifest.dispatch.values() if entry["plan"]}
    assert panels == {3 * LANES}
    loaded = load_artifact(packed_artifact)
    stored = {name: shape for name, shape in manifest.parameters}
    packed_shapes = [list(p.shape) for p in loaded.params if len(p.shape) == 3]
    assert len(packed_shapes) == 6 * 4  # every layer's four dense weights (q/k/v in one), packed once at load
    assert all(shape[2] == 3 * LANES for shape in packed_shapes)
    assert len(loaded.params) < len(stored) + 1  # the unpacked copies are not kept besides
    engine = Engine(loaded)
    for batch, seq in ((1, 1), (1, 2), (1, 3), (3, 13), (1, 60), (1, 61), (2, 100), (8, 64)):
        _check(engine, minilm_reference, batch, seq)


def test_packing_at_load_leaves_the_weights_resident_once(packed_artifact: Path) -> None:
    """The packed weights are copied onto huge pages; the buffers the packing wrote them to must go
    back to the system, not stay in the VM's pool (which keeps every freed buffer for reuse)."""
    measured = resident_growth_of_load(packed_artifact)
    assert measured["grown"] < 1.2 * measured["weights"], measured


def test_manifest_lists_the_linked_plans_variants_and_call_sites(linked_artifact: Path, minilm_tasks) -> None:
    manifest = Manifest.read(linked_artifact)
    assert {entry["workload"] for entry in manifest.dispatch.values()} == {t.workload for t in minilm_tasks.tasks}
    dense = [e for e in manifest.dispatch.values() if e["tree"].get("var") == "batch * seq_len"]
    assert dense and all(sorted(e["variants"]) == sorted(VARIANTS) and e["plan"] for e in dense)
    assert sum(e["calls"] for e in dense) == 6 * 4  # q/k/v (one), attention output, intermediate, output per layer
    assert all(not name.startswith(("reshape", "cast")) for name in manifest.dispatch)
    # attention's scores and softmax became one kernel, one call per layer
    fused = [e for name, e in manifest.dispatch.items() if name.endswith(FUSED_SUFFIX)]
    assert len(fused) == 1 and fused[0]["calls"] == 6
    # ... and their task says so, for the tuner to time them fused (``test_softmax_task.py``)
    (fused_name,) = (name for name in manifest.dispatch if name.endswith(FUSED_SUFFIX))
    assert [t.operator for t in minilm_tasks.tasks if t.softmax] == [fused_name.removesuffix(FUSED_SUFFIX)]
    assert len(list((linked_artifact / "plans").glob("*.plan.json"))) == len(minilm_tasks.tasks)


def test_compiled_tree_chooses_what_the_mirror_chooses(linked_artifact: Path) -> None:
    """The tree lowered into TIR exactly as the link pass lowers it, with leaves that write their
    variant's index instead of computing, run at >= 50 shapes including every split +-1."""
    manifest = Manifest.read(linked_artifact)
    mirror = KernelDispatch(manifest.dispatch)
    func = _marker_func()
    output = _output_buffer(func)
    for name, entry in manifest.dispatch.items():
        if "var" not in entry["tree"]:
            continue
        index = {variant: i for i, variant in enumerate(entry["variants"])}

        def leaf(variant: str, index=index) -> tirx.Stmt:
            return tirx.BufferStore(output, tirx.const(float(index[variant]), "float32"), [tirx.const(0, "int64")])

        lib = tvm.compile(func.with_body(lower_tree(func, entry["tree"], leaf)), tvm.target.Target("llvm"))
        shapes = {(batch, seq) for seq in (1, 2, 3, 4, 5, 39, 40, 41, 100, 199, 200, 201, 511, 512)
                  for batch in (1, 2, 3, 8)}
        for _var, le in thresholds(entry["tree"]):
            for rows in (le, le + 1):
                shapes |= {(1, rows)} if rows <= 512 else set()
        assert len(shapes) >= 50
        for batch, seq in sorted(shapes):
            out = tvm.runtime.tensor(np.full(1, -1, "float32"))
            lib["marker"](tvm.runtime.tensor(np.zeros((batch * seq, 4), "float32")), out, batch, seq)
            compiled = entry["variants"][int(out.numpy()[0])]
            mirrored = dict(((op, v) for op, v, _ in mirror.variants(batch, seq)))[name]
            expected = choose(entry["tree"], {"batch": batch, "seq_len": seq})
            assert compiled == mirrored == expected, (name, batch, seq)


def _marker_func() -> tirx.PrimFunc:
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def marker(a: T.handle, o: T.handle, batch: T.int64, seq_len: T.int64):
        # batch and seq_len are scalar params, as in the model's fused operators
        T.func_attr({"global_symbol": "marker"})
        A = T.match_buffer(a, (batch * seq_len, 4), "float32")
        O = T.match_buffer(o, (1,), "float32")
        O[0] = A[0, 0] * T.float32(0)

    return marker


def _output_buffer(func: tirx.PrimFunc):
    store = func.body  # the marker's whole body is one store to its output
    assert isinstance(store, tirx.BufferStore), type(store)
    return store.buffer


def test_no_plans_builds_the_untuned_artifact(tmp_path: Path, cache_dir: Path, minilm_artifact: Path) -> None:
    empty = tmp_path / "plans"
    empty.mkdir()
    same = compile_artifact(CompileRequest(model="default", max_batch=MAX_BATCH, plans=(empty,)), cache_dir)
    assert same == minilm_artifact
    assert all(entry["variants"] == [DEFAULT_VARIANT] for entry in Manifest.read(same).dispatch.values())


@pytest.mark.parametrize("change, message", [
    ({"tvm_version": "0.26.0"}, "tuned with TVM 0.26.0"),
    ({"target": {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": "2"}}, "mcpu='skylake-avx512'"),
    ({"workload": "0123456789abcdef"}, "foreign plan"),
])
def test_stale_and_foreign_plans_are_refused(change, message, minilm_tasks, tmp_path, cache_dir) -> None:
    plan = dataclasses.replace(handmade_plan(minilm_tasks.tasks[0], minilm_tasks.target), **change)
    plan.write(tmp_path / "bad.plan.json")
    with pytest.raises(PlanError, match=message):
        compile_artifact(CompileRequest(model="default", max_batch=MAX_BATCH, plans=(tmp_path,), layout=LAYOUT_PADDED),
                         cache_dir)


def test_tune_command_tunes_links_and_is_a_cache_hit_the_second_time(tmp_path: Path, cache_dir: Path,
                                                                     minilm_reference) -> None:
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("5 9 9 17 33 33 33 64 120")
    command = [sys.executable, "-m", "dietserve", "tune", "--model", "default", "--layout", "padded", "--trials", "3",
               "--max-batch", str(MAX_BATCH), "--lengths", str(lengths), "--db", str(tmp_path / "records.jsonl"),
               "--out", str(tmp_path / "out"), "--cache-dir", str(cache_dir)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    artifact = Path(first.stdout.strip().splitlines()[-1])
    plans = sorted((tmp_path / "out" / "plans").glob("*.plan.json"))
    assert len(plans) == len(Manifest.read(artifact).dispatch) >= 6
    plan = KernelPlan.read(plans[0])
    assert plan.provenance["weights"] and plan.provenance["trials"] >= 1  # the observed lengths weighted it
    engine = Engine(load_artifact(artifact))
    for batch, seq in ((1, 9), (2, 33), (1, 300)):
        _check(engine, minilm_reference, batch, seq)
    # A plan an earlier version of the model left in the folder (a workload it no longer has)
    # is not linked: the second run is still a cache hit.
    stale = plan_path(tmp_path / "out" / "plans", "0123456789abcdef")
    dataclasses.replace(plan, workload="0123456789abcdef").write(stale)
    second = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stderr.count("is up to date") == len(plans) + 1  # every plan, then the artifact
    assert f"not linking 1 plan(s) in {tmp_path / 'out' / 'plans'}" in second.stderr
    records = (tmp_path / "records.jsonl").read_text().splitlines()
    assert all(json.loads(line)["workload"].startswith("matmul[") for line in records)
    # The scores were timed with their softmax, as served: their own records, their plan says so.
    assert any(json.loads(line)["workload"].endswith("]+softmax") for line in records)
    assert sum(KernelPlan.read(path).provenance["softmax"] for path in plans) == 1


def test_server_counts_operator_executions_by_the_variant_its_tree_chose(linked_artifact: Path) -> None:
    server = ServerProcess(linked_artifact, "--no-batching", model_name="tuned")
    try:
        with triton.InferenceServerClient(server.grpc_url) as client:
            for seq in (2, 30, 100, 300):
                ids = np.full((1, seq), 101, np.int64)
                tensor = triton.InferInput("input_ids", [1, seq], "INT64")
                tensor.set_data_from_numpy(ids)
                client.infer("tuned", [tensor])
        samples = metrics_after_batches(server, 4)
    finally:
        server.stop()
    counts = {(dict(labels)["operator"], dict(labels)["variant"]): value
              for (name, labels), value in samples.items() if name == "dietserve_kernel_dispatch_total"}
    manifest = Manifest.read(linked_artifact)
    dense = [name for name, e in manifest.dispatch.items() if e["tree"].get("var") == "batch * seq_len"]
    for name in dense:
        variants = {v: n for (op, v), n in counts.items() if op == name}
        calls = manifest.dispatch[name]["calls"]
        # one request per interval (2, 30, 100, 300 rows); warm-up runs may add to some counts
        assert set(variants) == set(VARIANTS), (name, variants)
        assert all(n >= calls and n % calls == 0 for n in variants.values()), (name, variants)


BLOCKED = ("torch", "xgboost", "matplotlib", "scipy", "tuner")
SERVE_WITHOUT_TUNER = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is blocked: serving must not need it")
sys.meta_path.insert(0, Block())
import numpy as np
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine
import dietserve.server.app
engine = Engine(load_artifact(sys.argv[1]))
print(engine.run(np.full((2, 50), 101)).last_hidden_state.shape)
"""


def test_serving_a_tuned_artifact_needs_neither_the_tuner_nor_its_extras(linked_artifact: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SERVE_WITHOUT_TUNER, str(linked_artifact)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(2, 50, 384)"
