"""The packed encoder's attention kernel (``kernels/cpu_varlen``) against numpy: each sequence's
softmax attention over itself alone, for mixes of lengths and the register tiles it is built with."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from dietserve.host.cpu import configure_cpu_threads, cpu_flags
from dietserve.host.hardware import CPU_PRESETS
from dietserve.kernels.cpu_varlen.attention import query_parts_for, varlen_attention
from dietserve.kernels.cpu_varlen.tile import VarlenTile, attention_tiles, context_tile, same_code, tile_for
from dietserve.kernels.tir.build import build

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
MAX_LEN = 512


def built(heads: int, head_dim: int, tile: VarlenTile | dict, tree: dict | None = None, target=TARGET, **options):
    """The kernel alone, as a callable (in a model it is a ``call_tir`` of the forward function)."""
    func = varlen_attention(heads, head_dim, MAX_LEN, tile, tree, **options).with_attr("global_symbol", "main")
    return build(tvm.IRModule({"main": func}), target)["main"]


def target_for(tile: VarlenTile) -> tvm.target.Target:
    """The target a tile's vectors need: AVX-512 for 16 lanes (skipped on a CPU without it)."""
    if tile.lanes != 16:
        return TARGET
    if "avx512f" not in (cpu_flags() or set()):
        pytest.skip("this CPU has no AVX-512")
    return tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})


def reference(qkv: np.ndarray, starts: np.ndarray, heads: int, head_dim: int, bias: np.ndarray | None = None,
              kv_heads: int | None = None) -> np.ndarray:
    """Per sequence and head: softmax(q k^T / sqrt(d) + relative bias) v, in float64; ``bias``
    ``[heads, 2 * MAX_LEN - 1]``, indexed by key - query; ``kv_heads``: query head h reads key
    and value head h // (heads / kv_heads), as transformers' ``repeat_kv`` repeats them."""
    width, kv_heads = heads * head_dim, kv_heads or heads
    out = np.zeros((qkv.shape[0], width))
    for first, end in zip(starts[:-1], starts[1:], strict=True):
        block = qkv[first:end].astype(np.float64)
        for h in range(heads):
            g = h // (heads // kv_heads)
            q = block[:, h * head_dim:(h + 1) * head_dim]
            k, v = (block[:, (heads + offset + g) * head_dim:(heads + offset + g + 1) * head_dim]
                    for offset in (0, kv_heads))
            scores = q @ k.T / np.sqrt(head_dim)
            if bias is not None:
                positions = np.arange(end - first)
                scores += bias[h][positions[None, :] - positions[:, None] + MAX_LEN - 1]
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[first:end, h * head_dim:(h + 1) * head_dim] = (weights / weights.sum(axis=1, keepdims=True)) @ v
    return out


def run(function, qkv: np.ndarray, lengths: list[int], width: int, *bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    out = tvm.runtime.tensor(np.full((qkv.shape[0], width), np.nan, np.float32))
    function(tvm.runtime.tensor(qkv), tvm.runtime.tensor(starts), *[tvm.runtime.tensor(b) for b in bias], out)
    return out.numpy(), starts


MIXES = [[1], [2], [3, 1], [7, 1, 13], [MAX_LEN], [31, 2, 97, 5, 1], [128, 64, 61], [1, MAX_LEN, 17]]


@pytest.mark.parametrize("tile", [VarlenTile(), VarlenTile(mr=6, nr=16, nc=16), VarlenTile(mr=1, nr=8, nc=8),
                                  VarlenTile(mr=3, nr=24, nc=32)], ids=lambda t: t.describe())
def test_each_sequence_attends_to_itself_alone(tile: VarlenTile) -> None:
    configure_cpu_threads(2)
    heads, head_dim = 2, 64
    function = built(heads, head_dim, tile)
    rng = np.random.default_rng(0)
    for lengths in MIXES:
        # scores far apart (scaled inputs): a softmax that ignored the row max would overflow
        qkv = (rng.standard_normal((sum(lengths), 3 * heads * head_dim)) * 3).astype(np.float32)
        out, starts = run(function, qkv, lengths, heads * head_dim)
        expected = reference(qkv, starts, heads, head_dim)
        error = np.abs(out - expected).max() / np.abs(expected).max()  # (float32 sums of up to 512 terms)
        assert error < 1e-5, f"lengths {lengths}: max error {error:.2e} of the largest output"


@pytest.mark.parametrize("tile", [VarlenTile(), VarlenTile(mr=3, nr=24, nc=32), tile_for(CPU_PRESETS["avx512"])],
                         ids=lambda t: t.describe())
def test_relative_position_bias_is_added_by_distance(tile: VarlenTile) -> None:
    """MPNet's bias: each head's score of query i for key j gains ``bias[h, j - i + MAX_LEN - 1]``;
    every distance a 512-token sequence reaches holds a different value, so a wrong index shows."""
    configure_cpu_threads(2)
    heads, head_dim = 2, 64
    function = built(heads, head_dim, tile, target=target_for(tile), relative_bias=True)
    rng = np.random.default_rng(1)
    bias = (rng.standard_normal((heads, 2 * MAX_LEN - 1)) * 2).astype(np.float32)
    for lengths in MIXES:
        qkv = rng.standard_normal((sum(lengths), 3 * heads * head_dim)).astype(np.float32)
        out, starts = run(function, qkv, lengths, heads * head_dim, bias)
        expected = reference(qkv, starts, heads, head_dim, bias)
        error = np.abs(out - expected).max() / np.abs(expected).max()
        assert error < 1e-5, f"lengths {lengths}: max error {error:.2e} of the largest output"


@pytest.mark.parametrize("tile", [VarlenTile(), VarlenTile(mr=3, nr=24, nc=32), tile_for(CPU_PRESETS["avx512"])],
                         ids=lambda t: t.describe())
@pytest.mark.parametrize("reach", [0, 8, 64, "causal"], ids=lambda r: r if r == "causal" else f"window {r}")
def test_a_masked_query_attends_within_its_reach_alone(tile: VarlenTile, reach) -> None:
    """ModernBERT's windowed layers (a query attends to the keys at most ``reach`` away) and a
    decoder's (to itself and the keys before it). The kernel gets the mask as a bias
    (``model/modernbert.window_bias``) and skips the key tiles wholly outside it; the reference
    masks exactly, query by query."""
    from dietserve.model.modernbert import window_bias

    configure_cpu_threads(2)
    heads, head_dim = 2, 64
    causal, window = reach == "causal", None if reach == "causal" else reach
    function = built(heads, head_dim, tile, target=target_for(tile), relative_bias=True, window=window, causal=causal)
    bias = window_bias(heads, MAX_LEN, window, causal)
    distance = np.arange(1 - MAX_LEN, MAX_LEN)
    exact = np.where(distance <= 0 if causal else np.abs(distance) <= window, 0.0, -np.inf)
    rng = np.random.default_rng(2)
    for lengths in MIXES:
        qkv = (rng.standard_normal((sum(lengths), 3 * heads * head_dim)) * 3).astype(np.float32)
        out, starts = run(function, qkv, lengths, heads * head_dim, bias)
        expected = reference(qkv, starts, heads, head_dim, np.broadcast_to(exact, (heads, exact.size)))
        error = np.abs(out - expected).max() / np.abs(expected).max()
        assert error < 1e-5, f"{reach}, lengths {lengths}: max error {error:.2e} of the largest output"


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_shared_key_and_value_heads_serve_their_group(kv_heads: int) -> None:
    """Grouped-query attention (Qwen3's): 4 query heads over 1 or 2 key and value heads, the
    block ``[T, (heads + 2 * kv_heads) * head_dim]`` as the fused projection computes it."""
    configure_cpu_threads(2)
    heads, head_dim = 4, 32
    function = built(heads, head_dim, VarlenTile(), kv_heads=kv_heads)
    rng = np.random.default_rng(6)
    for lengths in MIXES:
        qkv = (rng.standard_normal((sum(lengths), (heads + 2 * kv_heads) * head_dim)) * 3).astype(np.float32)
        out, starts = run(function, qkv, lengths, heads * head_dim)
        expected = reference(qkv, starts, heads, head_dim, kv_heads=kv_heads)
        error = np.abs(out - expected).max() / np.abs(expected).max()
        assert error < 1e-5, f"lengths {lengths}: max error {error:.2e} of the largest output"


@pytest.mark.parametrize("parts", [2, 3, 5])
@pytest.mark.parametrize("reach", [None, 8], ids=["full", "window 8"])
def test_query_parts_split_each_sequence_and_change_nothing(parts: int, reach) -> None:
    """A (head, sequence) split into ``parts`` tasks over its query tiles (3 heads on 2 cores):
    every row computed once or, where a last tile steps back over its neighbour's rows, twice
    alike; sequences of fewer tiles than parts leave tasks empty. Shared heads, a tree of two
    tiles and a window, as EmbeddingGemma's layers run."""
    from dietserve.model.modernbert import window_bias

    configure_cpu_threads(2)
    heads, head_dim, kv_heads = 3, 32, 1
    tiles = {"short": VarlenTile(mr=3, nr=8, nc=8), "long": VarlenTile()}
    tree = {"var": "length", "le": 20, "then": {"variant": "short"}, "else": {"variant": "long"}}
    bias = None if reach is None else window_bias(heads, MAX_LEN, reach)
    options = {"relative_bias": True, "window": reach} if reach is not None else {}
    function = built(heads, head_dim, tiles, tree, kv_heads=kv_heads, query_parts=parts, **options)
    rng = np.random.default_rng(8)
    for lengths in MIXES:
        qkv = (rng.standard_normal((sum(lengths), (heads + 2 * kv_heads) * head_dim)) * 3).astype(np.float32)
        out, starts = run(function, qkv, lengths, heads * head_dim, *([] if bias is None else [bias]))
        expected = reference(qkv, starts, heads, head_dim, bias, kv_heads=kv_heads)
        error = np.abs(out - expected).max() / np.abs(expected).max()
        assert error < 1e-5, f"{parts} parts, lengths {lengths}: max error {error:.2e} of the largest output"


def test_query_parts_fill_the_cores_the_heads_leave_idle() -> None:
    assert [query_parts_for(heads, 2) for heads in (12, 16, 3, 1)] == [1, 1, 2, 2]
    assert [query_parts_for(heads, 16) for heads in (16, 12, 3)] == [1, 4, 16]
    assert query_parts_for(3, None) == 1


@pytest.mark.skipif("avx512f" not in (cpu_flags() or set()), reason="this CPU has no AVX-512")
@pytest.mark.parametrize("tile", [tile_for(CPU_PRESETS["avx512"]), VarlenTile(mr=1, nr=16, nc=16, lanes=16),
                                  VarlenTile(mr=4, nr=48, nc=64, lanes=16)], ids=lambda t: t.describe())
@pytest.mark.parametrize("head_dim", [64, 32, 40])
def test_avx512_tiles_match_numpy(head_dim: int, tile: VarlenTile) -> None:
    """16-lane tiles, as an AVX-512 CPU's hardware model gives: K transposed 16 x 16 in registers
    where the head is whole vectors (64, 32) and element by element where not (40), the
    exponentials by ``vscalefps``."""
    configure_cpu_threads(2)
    heads = 2
    function = built(heads, head_dim, tile, target=tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"}))
    rng = np.random.default_rng(head_dim)
    for lengths in MIXES:
        qkv = (rng.standard_normal((sum(lengths), 3 * heads * head_dim)) * 3).astype(np.float32)
        out, starts = run(function, qkv, lengths, heads * head_dim)
        expected = reference(qkv, starts, heads, head_dim)
        error = np.abs(out - expected).max() / np.abs(expected).max()
        assert error < 1e-5, f"lengths {lengths}: max error {error:.2e} of the largest output"


@pytest.mark.parametrize("head_dim", [12, 7, 40])
def test_heads_of_any_width(head_dim: int) -> None:
    """Heads that are no whole number of the tile's vectors (a small BERT's 12, an odd 7) run on
    narrower context tiles."""
    configure_cpu_threads(2)
    heads, tile = 3, tile_for(CPU_PRESETS["avx2"])
    columns, lanes = context_tile(head_dim, tile)
    assert head_dim % columns == 0 and columns % lanes == 0 and tile.lanes % lanes == 0
    function = built(heads, head_dim, tile)
    rng = np.random.default_rng(head_dim)
    for lengths in ([1], [7, 1, 13], [31, 2, 97]):
        qkv = (rng.standard_normal((sum(lengths), 3 * heads * head_dim)) * 3).astype(np.float32)
        out, starts = run(function, qkv, lengths, heads * head_dim)
        expected = reference(qkv, starts, heads, head_dim)
        assert np.abs(out - expected).max() / np.abs(expected).max() < 1e-5, f"lengths {lengths}"


def test_every_length_up_to_the_maximum() -> None:
    """One sequence of each sampled length from 1 to 512, in one packed run, on the host's tile."""
    configure_cpu_threads(2)
    heads, head_dim = 1, 64
    tile = tile_for(CPU_PRESETS["avx2"])
    function = built(heads, head_dim, tile)
    lengths = list(range(1, 40)) + list(range(41, MAX_LEN + 1, 29)) + [MAX_LEN]
    qkv = np.random.default_rng(1).standard_normal((sum(lengths), 3 * heads * head_dim)).astype(np.float32)
    out, starts = run(function, qkv, lengths, heads * head_dim)
    error = np.abs(out - reference(qkv, starts, heads, head_dim)).max(axis=1)
    worst = int(np.argmax(error))
    assert error.max() < 2e-5, f"row {worst} (sequence of {lengths[np.searchsorted(starts, worst, 'right') - 1]})"


def test_tiles_are_chosen_from_the_register_file() -> None:
    avx2, avx512 = tile_for(CPU_PRESETS["avx2"]), tile_for(CPU_PRESETS["avx512"])
    assert (avx2.lanes, avx512.lanes) == (8, 16)
    for tile, registers in ((avx2, 16), (avx512, 32)):
        accumulators = tile.mr * tile.nr // tile.lanes
        assert accumulators + tile.nr // tile.lanes + 1 <= registers  # accumulators, operands, broadcast
    with pytest.raises(ValueError, match="whole 8-lane vectors"):
        VarlenTile(nr=12)


def test_a_length_tree_runs_each_sequence_on_its_own_tile() -> None:
    """A tuned kernel holds several tiles and a tree over each sequence's length: sequences on
    both sides of every threshold, in one packed run, each on the tile its length picks."""
    configure_cpu_threads(2)
    heads, head_dim = 2, 32
    tiles = {"short": VarlenTile(mr=1, nr=8, nc=32), "mid": VarlenTile(mr=6, nr=16, nc=8),
             "long": VarlenTile(mr=3, nr=32, nc=16)}
    tree = {"var": "length", "le": 5, "then": {"variant": "short"},
            "else": {"var": "length", "le": 100, "then": {"variant": "mid"}, "else": {"variant": "long"}}}
    function = built(heads, head_dim, tiles, tree)
    lengths = [1, 5, 6, 2, 100, 101, 13, MAX_LEN, 7, 99]
    qkv = (np.random.default_rng(2).standard_normal((sum(lengths), 3 * heads * head_dim)) * 3).astype(np.float32)
    out, starts = run(function, qkv, lengths, heads * head_dim)
    expected = reference(qkv, starts, heads, head_dim)
    assert np.abs(out - expected).max() / np.abs(expected).max() < 1e-5
    with pytest.raises(ValueError, match="unknown variant"):
        varlen_attention(heads, head_dim, MAX_LEN, tiles, {"variant": "other"})
    with pytest.raises(ValueError, match="branches on 'length' alone"):
        varlen_attention(heads, head_dim, MAX_LEN, tiles, {**tree, "var": "length + 1"})


@pytest.mark.parametrize("preset", ["avx2", "avx512"])
def test_the_tuned_space_fits_the_register_file(preset: str) -> None:
    """The tiles tuning times: each fits the registers in both products, none repeats another's
    code for these heads, and the hardware default is among them."""
    hardware = CPU_PRESETS[preset]
    tiles = attention_tiles(hardware, 64)
    assert same_code(tile_for(hardware), 64) in {same_code(tile, 64) for tile in tiles}
    for tile in tiles:
        for vectors in (tile.nr // tile.lanes, tile.nc // tile.lanes):
            assert tile.mr * vectors + vectors + 1 <= hardware.vector_registers, tile
    assert len({same_code(tile, 64) for tile in tiles}) == len(tiles)
