"""Hardware descriptions and micro-kernels are data: detected, overridable, storable."""

from __future__ import annotations

from pathlib import Path

import pytest

from dietserve.host.hardware import CPU_PRESETS, GPU_PRESETS, detect_cpu
from dietserve.kernels.plan.microkernel import MicroKernel


def _fake_sysfs(root: Path, caches: list[tuple[int, str, str]]) -> Path:
    for index, (level, kind, size) in enumerate(caches):
        folder = root / "cpu0" / "cache" / f"index{index}"
        folder.mkdir(parents=True)
        (folder / "level").write_text(f"{level}\n")
        (folder / "type").write_text(f"{kind}\n")
        (folder / "size").write_text(f"{size}\n")
    return root


def test_cpu_detection_reads_isa_and_caches(tmp_path: Path) -> None:
    sysfs = _fake_sysfs(tmp_path, [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K")])
    cpu = detect_cpu({"avx2", "fma"}, sysfs)
    assert (cpu.vector_bits, cpu.vector_registers, cpu.l1_bytes, cpu.l2_bytes) == (256, 16, 32768, 1 << 20)
    assert cpu.lanes() == 8 and cpu.cores >= 1
    wide = detect_cpu({"avx2", "avx512f"}, sysfs)
    assert (wide.vector_bits, wide.vector_registers, wide.lanes()) == (512, 32, 16)
    assert wide.with_overrides(cores=64).cores == 64


def test_missing_sysfs_falls_back_to_the_preset(tmp_path: Path) -> None:
    cpu = detect_cpu({"avx2"}, tmp_path / "absent")
    assert cpu.l2_bytes == CPU_PRESETS["avx2"].l2_bytes


def test_gpu_presets_name_their_architecture() -> None:
    assert GPU_PRESETS["h100"].arch == "sm_90" and GPU_PRESETS["t4"].arch == "sm_75"
    assert GPU_PRESETS["t4"].with_overrides(sm_count=46).sm_count == 46
    with pytest.raises(ValueError, match="sm_90"):
        GPU_PRESETS["h100"].with_overrides(arch="hopper")


def test_microkernel_round_trips_and_hashes() -> None:
    kernel = MicroKernel(tile=(("T", (6, 2)), ("N", (16,)), ("K", (4,))), unroll=16, vector=8)
    again = MicroKernel.from_json(kernel.to_json())
    assert again == kernel and hash(again) == hash(kernel)
    assert str(kernel) == "MicroKernel(T=6x2 N=16 K=4 vec=8 unroll=16 local)"
    assert len({kernel, again}) == 1


AVX512_HOST = {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"}
AVX2_HOST = {"sse4_2", "avx", "avx2", "fma", "f16c"}


@pytest.mark.parametrize(("host", "mcpu", "lanes"), [
    (AVX512_HOST, "haswell", 8), (AVX512_HOST, "znver3", 8), (AVX512_HOST, "skylake-avx512", 16),
    # the kernels are measured on this machine: only the instruction sets it has as well
    (AVX2_HOST, "skylake-avx512", 8), (AVX2_HOST, "znver3", 8)])
def test_a_named_cpu_gets_the_space_of_its_own_instruction_sets(monkeypatch, host: set, mcpu: str,
                                                                 lanes: int) -> None:
    """``--mcpu`` naming an older CPU (the artifact is to run there) sizes the tiles to that
    CPU's vector registers, not to this machine's: an AVX-512 host tuning for an AVX2 CPU must
    not hand it 16-lane tiles of 28 accumulators. (The host's flags are set here: the test
    passes alike on AVX2 and AVX-512 machines.)"""
    from tuner.targets import resolve_target

    monkeypatch.setattr("dietserve.host.cpu.cpu_flags", lambda: set(host))
    where = resolve_target("llvm", mcpu=mcpu)
    assert where.target["mcpu"] == mcpu and where.hardware.lanes() == lanes
    assert {kernel.vector for kernel in where.space} == {lanes}
    registers = where.hardware.vector_registers
    for kernel in (kernel for kernel in where.space if kernel.pack):
        (mr,) = kernel.tile_sizes("i")
        panel, pk, _groups = kernel.tile_sizes("j")
        assert mr * pk * panel // lanes < registers, kernel  # the accumulators, with room to load
