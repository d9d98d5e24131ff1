"""Manifest reading/writing and host capability checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dietserve.host.cpu import cpu_flags, first_cpu, missing_cpu_flags, runnable_cpu, target_cpu_flags
from dietserve.runtime.manifest import MANIFEST_FILE, ArtifactError, Manifest, write_text_atomic


def _manifest(**changes) -> Manifest:
    fields = dict(model_name="m", model_config={}, normalize_embeddings=False, target={"kind": "llvm"},
                  tvm_version="0.27.0", cache_key="k", bounds={"batch": 4, "seq_len": 512},
                  parameters=[], files={})
    fields.update(changes)
    return Manifest(**fields)


def test_manifest_round_trips(tmp_path: Path) -> None:
    write_text_atomic(tmp_path / MANIFEST_FILE, _manifest().to_json())
    read = Manifest.read(tmp_path)
    assert read == _manifest() and read.max_batch == 4 and read.max_seq_len == 512


def test_future_format_is_refused(tmp_path: Path) -> None:
    raw = json.loads(_manifest().to_json())
    raw["format_version"] = 99
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match="format version 99"):
        Manifest.read(tmp_path)


def test_corrupt_manifest_is_explained(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_FILE).write_text('{"model_name": ')
    with pytest.raises(ArtifactError, match="not valid JSON"):
        Manifest.read(tmp_path)


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    write_text_atomic(target, "old")


    with pytest.raises(TypeError):
        write_text_atomic(target, object())  # type: ignore[arg-type]
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"], "temporary file left behind"
    assert os.access(target, os.R_OK)


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma\n\nprocessor\t: 1\nflags\t: fpu\n")
    flags = cpu_flags(cpuinfo)
    assert flags == {"fpu", "sse4_2", "avx", "avx2", "fma"}
    assert missing_cpu_flags(["avx2", "avx512f"], flags) == ["avx512f"]
    assert missing_cpu_flags(["avx512f"], None) == []
    assert cpu_flags(tmp_path / "absent") is None


# /proc/cpuinfo's flags of a virtual machine whose CPU LLVM names ``emeraldrapids`` by its
# model number, while the hypervisor hides AMX.
EMERALD_RAPIDS_VM = set("fpu sse4_1 sse4_2 avx avx2 fma f16c avx512f avx512dq avx512cd avx512bw avx512vl avx512ifma "
                        "avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq avx512_bf16 "
                        "avx512_fp16".split())


def _llvm_flags(cpu: str) -> set[str]:
    import tvm

    return target_cpu_flags(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))


def test_a_cpu_missing_features_of_its_name_builds_for_one_it_can_run() -> None:
    assert "amx_tile" in _llvm_flags("emeraldrapids")  # (else this test would test nothing)
    chosen = runnable_cpu("emeraldrapids", EMERALD_RAPIDS_VM, "GenuineIntel")
    assert chosen != "emeraldrapids"
    assert _llvm_flags(chosen) <= EMERALD_RAPIDS_VM, "an artifact built for it would not load"
    assert "avx512f" in _llvm_flags(chosen), "the fallback threw away AVX-512 the machine has"
    # With AMX listed (its tiles and their bf16 products), the name LLVM gave stands.
    with_amx = EMERALD_RAPIDS_VM | {"amx_tile", "amx_bf16"}
    assert runnable_cpu("emeraldrapids", with_amx, "GenuineIntel") == "emeraldrapids"
    # An AMD VM without AVX-512 that LLVM calls znver4: an AVX2 Zen, not an Intel CPU.
    avx2 = {"sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c"}
    chosen = runnable_cpu("znver4", avx2, "AuthenticAMD")
    assert chosen.startswith("znver") and _llvm_flags(chosen) <= avx2 and "avx2" in _llvm_flags(chosen)
    assert runnable_cpu("znver4", None, "AuthenticAMD") == "znver4"  # no /proc/cpuinfo: cannot tell


def test_cpu_vendor_is_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t: fpu\n")
    assert first_cpu(cpuinfo)["vendor_id"] == "AuthenticAMD"
    assert first_cpu(tmp_path / "absent") is None


def test_a_bf16_artifact_for_amx_is_refused_where_linux_will_not_lend_the_tiles(monkeypatch) -> None:
    """An AMX host in a sandbox that blocks arch_prctl (neither exists here: both are stood in
    for): its bf16 kernels would end the process at the first call, so the load says why first.
    An fp32 artifact for the same CPU uses no tiles and loads."""
    import dietserve.runtime.artifact as artifact

    amx_host = {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    monkeypatch.setattr(artifact, "cpu_flags", lambda: amx_host)
    monkeypatch.setattr(artifact, "refused_tile_state", lambda: "Operation not permitted")
    built = dict(target={"kind": "llvm", "mcpu": "sapphirerapids"}, required_cpu_flags=sorted(amx_host))
    with pytest.raises(ArtifactError, match="may use AMX tiles.*Operation not permitted.*--mcpu without AMX"):
        artifact.choose_device(_manifest(precision="bf16", **built))
    assert artifact.choose_device(_manifest(precision="fp32", **built)).dlpack_device_type() == 1  # the CPU


def test_linux_lends_the_tile_state_where_the_cpu_has_tiles() -> None:
    """The real request (the system call each AMX kernel makes): granted on a CPU with AMX,
    refused with a reason elsewhere."""
    from dietserve.host.cpu import refused_tile_state

    has_tiles = {"amx_tile", "amx_bf16"} <= (cpu_flags() or set())
    reason = refused_tile_state()
    assert (reason is None) == has_tiles, reason


def test_the_build_flags_and_record_give_the_request_back(tmp_path: Path) -> None:
    """What a child command (``build_argv``) and a re-tuning job (the manifest's build record)
    rebuild from is the request itself, ``--max-seq-len`` included."""
    import argparse
    import dataclasses

    from dietserve.commands.common import add_build_flags, build_argv, compile_request
    from dietserve.compile.artifact import CompileRequest

    parser = argparse.ArgumentParser()
    add_build_flags(parser)
    args = parser.parse_args(["--model", str(tmp_path.resolve()), "--max-seq-len", "128", "--pooling", "cls",
                              "--precision", "bf16", "--max-batch", "8"])
    request = compile_request(args)
    assert (request.max_seq_len, request.pooling, request.precision) == (128, ("cls",), "bf16")
    assert compile_request(parser.parse_args(build_argv(args))) == request
    rebuilt = CompileRequest.from_build_record(json.loads(json.dumps(request.build_record())))
    assert rebuilt == dataclasses.replace(request, analytic=False)  # (the record keeps no plans: the job makes them)
