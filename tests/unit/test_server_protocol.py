"""Server pieces without a server: the proto's wire compatibility with Triton's, reproducible
code generation, tensor decoding, buckets and padding, dispatch trees, configuration.

Request messages come from tritonclient's generated classes (wire-identical to ours); the test
process never imports dietserve.server._proto, whose protobuf package is the same."""

from __future__ import annotations

import asyncio
import filecmp
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from tritonclient.grpc import model_config_pb2, service_pb2

from dietserve.runtime.batcher import DynamicBatcher, Job, bucket_edges, pad_rows
from dietserve.runtime.engine import EncoderOutput
from dietserve.runtime.errors import Expired, InputError, NotReady, Overloaded
from dietserve.runtime.manifest import ArtifactError
from dietserve.runtime.request import EncoderRequest
from dietserve.runtime.variant_by_shape import KernelDispatch
from dietserve.server.codec import decode_input, decode_inputs
from dietserve.server.config import ConfigError, ServerConfig
from dietserve.server.protogen import VIRTUAL_ROOT, generate

PROTOS = Path(__file__).resolve().parents[2] / "protos"


# ---------------------------------------------------------------------------- the proto file


def _our_descriptors(tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    from grpc_tools import protoc

    out = tmp_path / "set.pb"
    source = PROTOS / "open_inference.proto"
    assert protoc.main(["protoc", f"-I{PROTOS}", f"--descriptor_set_out={out}", str(source)]) == 0
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (ours,) = files.file
    assert ours.package == "inference"
    return ours


def _messages(file: descriptor_pb2.FileDescriptorProto) -> dict[str, descriptor_pb2.DescriptorProto]:
    found = {}

    def walk(message, prefix):
        found[prefix + message.name] = message
        for nested in message.nested_type:
            walk(nested, prefix + message.name + ".")

    for message in file.message_type:
        walk(message, "")
    return found


def _triton_messages() -> dict[str, descriptor_pb2.DescriptorProto]:
    messages = {}
    for module in (service_pb2, model_config_pb2):
        file = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(file)
        messages.update(_messages(file))
    return messages


def test_proto_is_wire_compatible_with_triton(tmp_path):
    ours = _our_descriptors(tmp_path)
    theirs = _triton_messages()
    for name, message in _messages(ours).items():
        assert name in theirs, f"{name} is not a Triton message"
        their_fields = {f.name: f for f in theirs[name].field}
        for field in message.field:
            assert field.name in their_fields, f"{name}.{field.name} is not in Triton's {name}"
            reference = their_fields[field.name]
            assert (field.number, field.type, field.label) == (reference.number, reference.type, reference.label), \
                f"{name}.{field.name} differs from Triton's"
            assert field.type_name == reference.type_name, f"{name}.{field.name} has another message type"
    service = ours.service[0]
    assert service.name == "GRPCInferenceService"
    triton_methods = {m.name: m for m in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}
    required = {"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
                "ModelConfig", "ModelStatistics", "RepositoryIndex"}
    assert {m.name for m in service.method} == required
    for method in service.method:
        reference = triton_methods[method.name]
        assert method.input_type == "." + reference.input_type.full_name
        assert method.output_type == "." + reference.output_type.full_name


def test_code_generation_is_reproducible(tmp_path):
    first = generate(PROTOS, tmp_path / "a" / "_proto")
    second = generate(PROTOS, tmp_path / "b" / "_proto")
    assert [p.name for p in first] == [p.name for p in second]
    assert {"open_inference_pb2.py", "open_inference_pb2_grpc.py", "__init__.py"} <= {p.name for p in first}
    for a, b in zip(first, second, strict=True):
        assert filecmp.cmp(a, b, shallow=False), a.name
    grpc_module = (tmp_path / "a" / "_proto" / "open_inference_pb2_grpc.py").read_text()
    assert f"from {VIRTUAL_ROOT.replace('/', '.')} import open_inference_pb2" in grpc_module


# ---------------------------------------------------------------------------- tensors


def _tensor(name, datatype, shape):
    return service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape)


def test_decode_raw_and_typed_numbers():
    values = np.arange(6, dtype=np.int64).reshape(2, 3)
    np.testing.assert_array_equal(decode_input(_tensor("x", "INT64", [2, 3]), values.tobytes()), values)
    typed = _tensor("x", "INT64", [2, 3])
    typed.contents.int64_contents.extend(values.ravel().tolist())
    np.testing.assert_array_equal(decode_input(typed, None), values)
    floats = _tensor("f", "FP32", [3])
    floats.contents.fp32_contents.extend([0.5, 1.5, -2.0])
    np.testing.assert_array_equal(decode_input(floats, None), np.array([0.5, 1.5, -2.0], np.float32))


def test_decode_bytes_raw_and_typed():
    items = [b"hello", b"", "caf\u00e9".encode()]
    raw = b"".join(len(i).to_bytes(4, "little") + i for i in items)
    assert decode_input(_tensor("t", "BYTES", [3]), raw) == items
    typed = _tensor("t", "BYTES", [3])
    typed.contents.bytes_contents.extend(items)
    assert decode_input(typed, None) == items


@pytest.mark.parametrize("tensor, raw, message", [
    (_tensor("x", "INT64", [2, 3]), b"\0" * 40, "40 bytes of raw data; shape [2, 3] of INT64 needs 48"),
    (_tensor("x", "INT64", [-1, 3]), b"", "negative dimension"),
    (_tensor("x", "COMPLEX", [1]), b"\0", "does not define"),
    (_tensor("t", "BYTES", [2]), (5).to_bytes(4, "little") + b"abc", "runs past the data"),
    (_tensor("t", "BYTES", [2]), (1).to_bytes(4, "little") + b"a", "holds 1 BYTES elements but its shape needs 2"),
    (_tensor("t", "BYTES", [1]), b"\1\0", "ends inside an element length"),
    (_tensor("x", "INT32", [2]), None, "holds 0 INT32 values"),
])
def test_decode_errors_name_the_problem(tensor, raw, message):
    with pytest.raises(InputError) as raised:
        decode_input(tensor, raw)
    assert message in str(raised.value)


def test_raw_contents_must_cover_every_input():
    request = service_pb2.ModelInferRequest()
    request.inputs.add(name="a", datatype="INT64", shape=[1])
    request.inputs.add(name="b", datatype="INT64", shape=[1])
    request.raw_input_contents.append(np.int64(1).tobytes())
    with pytest.raises(InputError, match="1 entries for 2 inputs"):
        decode_inputs(request)


# ---------------------------------------------------------------------------- batching


def test_bucket_edges_bound_padding():
    ratio = 1.25
    edges = bucket_edges(512, ratio)
    assert edges[0] == 8 and edges[-1] == 512 and edges == sorted(set(edges))
    assert all(edge % 8 == 0 for edge in edges)
    for low, high in zip(edges, edges[1:], strict=False):
        if low >= 32:  # above the 8-token granularity the growth is the ratio, rounded to 8
            assert high <= low * ratio + 8
    assert bucket_edges(1, 1.5) == [1]


def _job(ids: np.ndarray, bucket: int = 0) -> Job:
    request = EncoderRequest(ids, np.ones_like(ids), np.zeros_like(ids), ("sentence_embedding",))
    return Job(request, bucket, future=None)


def test_pad_rows_pads_with_masked_zeros():
    a = np.array([[5, 6, 7]])
    b = np.array([[8], [9]])
    ids, mask, types = pad_rows([_job(a), _job(b)], 3)
    np.testing.assert_array_equal(ids, [[5, 6, 7], [8, 0, 0], [9, 0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [1, 0, 0], [1, 0, 0]])
    assert types.shape == (3, 3) and not types.any()


class _RecordingEngine:
    """Stands in for the VM (the real engine is exercised by the integration tests): returns
    each row's ids as its hidden state so the batcher's splitting can be checked exactly."""

    max_batch, max_seq_len = 8, 64
    packed = False

    def __init__(self):
        self.calls = []
        self.dispatch = KernelDispatch({})

    def execute(self, ids, mask, types):
        self.calls.append(ids.shape)
        hidden = np.repeat(ids[:, :, None].astype(np.float32), 2, axis=2)
        return EncoderOutput(hidden, (hidden * mask[:, :, None]).sum(axis=1))


def test_batcher_groups_one_bucket_and_splits_results():
    engine = _RecordingEngine()
    runs = []

    async def scenario():
        batcher = DynamicBatcher(engine, batching=True, max_batch_size=4, max_queue_delay_s=0.05,
                                 bucket_ratio=1.25, max_queue_rows=16, on_batch=runs.append)
        batcher.start()
        rows = [np.full((1, n), n) for n in (3, 5, 7)] + [np.full((1, 40), 40)]
        requests = [EncoderRequest(r, np.ones_like(r), np.zeros_like(r), ()) for r in rows]
        results = await asyncio.gather(*(batcher.submit(r) for r in requests))
        await batcher.close()
        return rows, results

    rows, results = asyncio.run(scenario())
    assert sorted(engine.calls) == [(1, 40), (3, 7)]  # 3, 5, 7 share the first bucket; 40 runs alone
    for row, result in zip(rows, results, strict=True):
        np.testing.assert_array_equal(result.output.last_hidden_state[..., 0], row)
        np.testing.assert_array_equal(result.output.sentence_embedding[:, 0], row.sum(axis=1))
    padded = next(run for run in runs if run.rows == 3)
    assert padded.real_tokens == 15 and padded.rows * padded.seq_len == 21


class _GatedEngine(_RecordingEngine):
    """Each execution waits until the test opens the gate, so the engine can be held busy."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.running = threading.Event()

    def execute(self, ids, mask, types):
        self.running.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return super().execute(ids, mask, types)


def _request(rows: int, seq: int, value: int = 1, deadline: float | None = None) -> EncoderRequest:
    ids = np.full((rows, seq), value, np.int64)
    return EncoderRequest(ids, np.ones_like(ids), np.zeros_like(ids), ("sentence_embedding",), deadline)


def _batcher(engine, **settings) -> DynamicBatcher:
    defaults = dict(batching=True, max_batch_size=8, max_queue_delay_s=0.05, bucket_ratio=1.25, max_queue_rows=64)
    return DynamicBatcher(engine, **{**defaults, **settings})


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


def test_batcher_refuses_when_the_queue_is_full():
    engine = _GatedEngine()

    async def scenario():
        batcher = _batcher(engine, max_queue_rows=2)
        batcher.start()
        running = asyncio.ensure_future(batcher.submit(_request(2, 4)))  # the engine takes it at once
        await _until(engine.running.is_set)
        queued = asyncio.ensure_future(batcher.submit(_request(2, 4)))  # waits: 2 rows, the limit
        await _until(lambda: batcher.queued_rows == 2)
        with pytest.raises(Overloaded, match="queue full: 2 rows are waiting"):
            await batcher.submit(_request(1, 4))
        engine.gate.set()
        await asyncio.gather(running, queued)
        await batcher.close()

    asyncio.run(scenario())


def test_idle_engine_runs_a_lone_request_without_the_queue_delay():
    engine = _RecordingEngine()

    async def scenario():
        batcher = _batcher(engine, max_queue_delay_s=2.0)
        batcher.start()
        started = time.monotonic()
        result = await batcher.submit(_request(1, 5))
        elapsed = time.monotonic() - started
        await batcher.close()
        return result, elapsed

    result, elapsed = asyncio.run(scenario())
    assert elapsed < 0.5, f"a lone request waited {elapsed:.3f} s of the 2 s delay"
    assert result.queue_seconds < 0.5


def test_requests_arriving_while_busy_batch_by_bucket():
    engine = _GatedEngine()

    async def scenario():
        batcher = _batcher(engine)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(_request(1, 30)))
        await _until(engine.running.is_set)
        waiting = [asyncio.ensure_future(batcher.submit(_request(1, n, n))) for n in (3, 5, 7, 60)]
        await _until(lambda: batcher.queued_rows == 4)
        engine.gate.set()
        results = await asyncio.gather(first, *waiting)
        await batcher.close()
        return results

    results = asyncio.run(scenario())
    assert engine.calls == [(1, 30), (3, 7), (1, 60)]  # 3, 5, 7 share a bucket; 60 has its own
    for n, result in zip((3, 5, 7, 60), results[1:], strict=True):
        np.testing.assert_array_equal(result.output.sentence_embedding[:, 0], [n * n])


def _packed_batcher(engine, max_batch_tokens: int) -> DynamicBatcher:
    engine.packed = True
    return DynamicBatcher(engine, batching=True, max_batch_size=8, max_queue_delay_s=0.05, bucket_ratio=1.25,
                          max_queue_rows=64, max_batch_tokens=max_batch_tokens)


def _run_while_busy(engine, batcher, waiting: list[tuple[int, int]]) -> list:
    """One request holds the engine while ``waiting`` ((rows, seq) each, value = seq) queue up."""
    async def scenario():
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(_request(1, 30)))
        await _until(engine.running.is_set)
        queued = [asyncio.ensure_future(batcher.submit(_request(rows, n, n))) for rows, n in waiting]
        await _until(lambda: batcher.queued_rows == sum(rows for rows, _ in waiting))
        engine.gate.set()
        results = await asyncio.gather(first, *queued)
        await batcher.close()
        return results[1:]

    return asyncio.run(scenario())


def test_a_packed_engine_batches_any_lengths_in_arrival_order_within_the_token_budget():
    """No buckets: 3, 60 and 5 tokens run together; the budget (70) closes the batch before the
    next request (7 + 60 + 5 + 7 > 70), which then heads the next one: first come, first served."""
    engine = _GatedEngine()
    waiting = [(1, 3), (1, 60), (1, 5), (1, 7), (1, 9)]
    results = _run_while_busy(engine, _packed_batcher(engine, max_batch_tokens=70), waiting)
    assert engine.calls == [(1, 30), (3, 60), (2, 9)]
    for (_, n), result in zip(waiting, results, strict=True):
        np.testing.assert_array_equal(result.output.sentence_embedding[:, 0], [n * n])
        assert result.output.last_hidden_state.shape == (1, n, 2)


def test_a_request_over_the_token_budget_runs_alone_and_is_never_split():
    engine = _GatedEngine()
    waiting = [(4, 50), (1, 3), (2, 8)]  # 200 tokens, over the budget of 100
    results = _run_while_busy(engine, _packed_batcher(engine, max_batch_tokens=100), waiting)
    assert engine.calls == [(1, 30), (4, 50), (3, 8)]
    np.testing.assert_array_equal(results[0].output.sentence_embedding[:, 0], [2500] * 4)
    assert results[0].run.real_tokens == 200 and results[2].run.real_tokens == 19


def test_a_cancelled_request_leaves_the_queue_and_is_not_computed():
    engine = _GatedEngine()

    async def scenario():
        batcher = _batcher(engine)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(_request(1, 4)))
        await _until(engine.running.is_set)
        abandoned = asyncio.ensure_future(batcher.submit(_request(3, 4, 2)))
        await _until(lambda: batcher.queued_rows == 3)
        abandoned.cancel()
        await _until(lambda: batcher.queued_rows == 0)
        engine.gate.set()
        await first
        later = await batcher.submit(_request(1, 4, 3))
        await batcher.close()
        return batcher, later

    batcher, later = asyncio.run(scenario())
    assert engine.calls == [(1, 4), (1, 4)] and batcher.withdrawn == 1
    assert later.output.sentence_embedding[0, 0] == 12


def test_a_request_past_its_deadline_is_answered_expired_not_computed():
    engine = _GatedEngine()

    async def scenario():
        batcher = _batcher(engine)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(_request(1, 4)))
        await _until(engine.running.is_set)
        late = asyncio.ensure_future(batcher.submit(_request(2, 4, deadline=time.monotonic() + 0.05)))
        await asyncio.sleep(0.1)
        engine.gate.set()
        await first
        with pytest.raises(Expired, match="deadline passed after"):
            await late
        await batcher.close()
        return batcher

    batcher = asyncio.run(scenario())
    assert engine.calls == [(1, 4)] and batcher.expired == 1


def test_a_failing_batch_callback_does_not_stop_execution():
    engine = _RecordingEngine()
    calls = []

    def failing(run):
        calls.append(run)
        raise RuntimeError("injected: metrics backend is down")

    async def scenario():
        batcher = _batcher(engine, on_batch=failing)
        batcher.start()
        results = [await batcher.submit(_request(1, n, n)) for n in (2, 3, 4)]
        await batcher.close()
        return batcher, results

    batcher, results = asyncio.run(scenario())
    assert len(calls) == 3 and batcher.stopped is None
    assert [r.output.sentence_embedding[0, 0] for r in results] == [4, 9, 16]


def test_a_broken_scheduler_fails_waiting_requests_and_reports_it():
    engine = _GatedEngine()
    stopped = []

    async def scenario():
        batcher = _batcher(engine, on_stopped=stopped.append)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(_request(1, 4)))
        await _until(engine.running.is_set)
        queued = asyncio.ensure_future(batcher.submit(_request(1, 4)))
        await _until(lambda: batcher.queued_rows == 1)

        def broken(bucket):
            raise RuntimeError("injected scheduler bug")

        batcher._take = broken
        engine.gate.set()
        await first
        with pytest.raises(NotReady, match="execution has stopped"):
            await queued
        with pytest.raises(NotReady, match="execution has stopped"):
            await batcher.submit(_request(1, 4))
        await batcher.close()

    asyncio.run(scenario())
    assert len(stopped) == 1 and "injected scheduler bug" in str(stopped[0])


# ---------------------------------------------------------------------------- dispatch, config


VARS = ["batch", "seq_len"]


def test_dispatch_tree_chooses_by_shape_expressions_and_counts_call_sites():
    tree = {"var": "batch * seq_len", "le": 64,
            "then": {"variant": "small"},
            "else": {"var": "seq_len", "le": 256, "then": {"variant": "mid"}, "else": {"variant": "large"}}}
    dispatch = KernelDispatch({
        "dense": {"variants": ["small", "mid", "large"], "tree": tree, "shape_vars": VARS, "calls": 12},
        "scores": {"variants": ["default"], "tree": {"variant": "default"}, "shape_vars": VARS, "calls": 6}})
    assert dispatch.variants(1, 64) == (("dense", "small", 12), ("scores", "default", 6))
    assert dispatch.variants(2, 33)[0][1] == "mid"  # 66 rows
    assert dispatch.variants(2, 32)[0][1] == "small"  # 64 rows: the boundary itself
    assert dispatch.variants(1, 300)[0][1] == "large"


@pytest.mark.parametrize("table, message", [
    ({"op": {"variants": ["a"], "tree": {"variant": "b"}}}, "unknown variant 'b'"),
    ({"op": {"variants": [], "tree": {"variant": "a"}}}, "lists no variants"),
    ({"op": {"variants": ["a"], "tree": {"var": "seq_len", "le": 3, "then": {"variant": "a"}}, "shape_vars": VARS}},
     "needs var, integer le, then and else"),
    ({"op": {"variants": ["a"], "shape_vars": VARS,
             "tree": {"var": "width", "le": 3, "then": {"variant": "a"}, "else": {"variant": "a"}}}}, "names 'width'"),
    ({"op": {"variants": ["a"], "shape_vars": VARS,
             "tree": {"var": "__import__('os')", "le": 3, "then": {"variant": "a"}, "else": {"variant": "a"}}}},
     "may only use names, integers"),
])
def test_dispatch_rejects_malformed_tables(table, message):
    with pytest.raises(ArtifactError, match=message):
        KernelDispatch(table)


@pytest.mark.parametrize("change, message", [
    ({"port": 70000}, "--port"), ({"max_batch_size": 0}, "--max-batch-size"),
    ({"bucket_ratio": 1.0}, "--bucket-ratio"), ({"max_queue_rows": 0}, "--max-queue-rows"),
    ({"max_queue_delay_ms": -1}, "--max-queue-delay-ms"), ({"grace_seconds": -1}, "--grace-seconds"),
    ({"max_concurrent_rpcs": 0}, "--max-concurrent-rpcs"), ({"max_response_bytes": 10}, "--max-response-bytes"),
    ({"tls_client_ca": Path("ca.pem")}, "--tls-client-ca needs --tls-cert"),
    ({"http_port": 70000}, "--http-port 70000"), ({"http_body_timeout_seconds": 0}, "--http-body-timeout-seconds"),
])
def test_config_rejects_out_of_range_settings(change, message):
    with pytest.raises(ConfigError, match=message):
        ServerConfig(artifact=None, **change)


def test_http_flags_parse_into_the_config():
    import argparse

    from dietserve.server.config import add_server_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    default = config_from_args(parser.parse_args([]), None)
    assert (default.http_port, default.truncate) == (8000, False)  # HTTP on, over-long text refused
    changed = config_from_args(parser.parse_args(["--no-http", "--truncate"]), None)
    assert (changed.http_port, changed.truncate) == (None, True)
    assert config_from_args(parser.parse_args(["--http-port", "0"]), None).http_port == 0
