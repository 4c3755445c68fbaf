"""The Triton read over the store's packed codes (dequantized in registers, ``kvcert.kernels.packed``): bit for bit
the read over the decode scratch, with the scratch poisoned wherever the codes are read, per codec; the mirror
follows sliding-window trims and evictions."""

from __future__ import annotations

import math

import pytest
import torch

from kvcert import quant
from kvcert.bounds import true_tv
from kvcert.cache.store import LayerStore
from kvcert.kernels import triton_read
from kvcert.kernels.packed import MODES, code_tiles

torch.set_num_threads(1)
SC = 0.125

#: codec name, options, the mode the kernels decode it in
IN_REGISTERS = [
    ("int8", {}, "rtn8"),
    ("int4", {}, "rtn_packed"),
    ("int2", {"group_size": 16}, "rtn_packed"),
    ("dither-int8", {}, "dither"),
    ("kivi-2", {"group_size": 8, "residual_window": 8}, "kivi_tokens"),
    ("kivi-4", {"axis": "value", "group_size": 16, "residual_window": 0}, "kivi_channels"),
    ("none", {}, "fp16"),
]


def _store(codec: str, opts: dict, gen: torch.Generator, b: int = 2, h: int = 2, d: int = 32, s: int = 72):
    """A store written in three chunks of ``s/3`` tokens (write block 8: several codec chunks, a pending tail),
    with one persistently repaired range; returns it and the exact K/V."""
    store = LayerStore(
        0, quant.get(codec, **opts), quant.get(codec, **opts), bands=4, pairing="rotate_half", seed=5, write_block=8
    )
    k, v = torch.randn(b, h, s, d, generator=gen) * 2, torch.randn(b, h, s, d, generator=gen)
    rows, keep = torch.arange(b) + 1, torch.zeros(b, dtype=torch.bool)
    for t0 in range(0, s, s // 3):
        store.append(k[:, :, t0 : t0 + s // 3], v[:, :, t0 : t0 + s // 3], rows, keep)
    store.make_exact(b - 1, 0, slice(2, 7))
    return store, k, v


def _read(store: LayerStore, q: torch.Tensor, mask: torch.Tensor | None, nq: int, tiles: bool, splits: int = 2):
    return triton_read.read_store(q, store, mask, nq, SC, splits=splits, packed=tiles)


def _poison(store: LayerStore) -> int:
    """Set the scratch to NaN wherever it is served from codes (not exact); returns how many entries."""
    assert store.k is not None and store.v is not None
    n = 0
    for ts in (store.k, store.v):
        coded = ~ts.exact.view()
        ts.served.view()[coded] = math.nan
        n += int(coded.sum())
    return n


def _assert_same(a: triton_read.TritonRead, b: triton_read.TritonRead) -> None:
    for name in a._fields:
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num()), name


def _assert_poisoned_read_same(store: LayerStore, q: torch.Tensor) -> None:
    """The read over the codes with the scratch poisoned where codes are read = the read over the scratch."""
    ref = _read(store, q, None, 1, tiles=False, splits=1)
    assert _poison(store) > 0
    got = _read(store, q, None, 1, tiles=True, splits=1)
    assert ref is not None and got is not None
    _assert_same(ref, got)


@pytest.mark.parametrize(("codec", "opts", "mode"), IN_REGISTERS)
def test_packed_read_is_the_scratch_read_bit_for_bit_and_sound_per_cell(codec: str, opts: dict, mode: str) -> None:
    """GQA (2 query heads per KV head, 2 queries each), a per-head mask with a dead row, batch 2, repaired and
    pending entries: every field of the read over the codes equals the read over the scratch, with the scratch
    poisoned (NaN) wherever codes are read; and per cell the certificate bounds the true TV to exact attention,
    the output bound the output error, the radius the logit error."""
    gen = torch.Generator().manual_seed(7)
    store, k, v = _store(codec, opts, gen)
    b, h, s, d = k.shape
    nq, g = 2, 2
    q = torch.randn(b, h, g * nq, d, generator=gen) * 3
    mask = torch.rand(b, h, nq, s, generator=gen) > 0.25
    mask[1, 1, 0] = False
    kt, vt = code_tiles(store)
    assert kt.mode == vt.mode == MODES[mode]
    ref = _read(store, q, mask, nq, tiles=False)
    assert _poison(store) > 0
    got = _read(store, q, mask, nq, tiles=True)
    assert ref is not None and got is not None
    _assert_same(ref, got)
    vis = mask[:, :, torch.arange(g * nq) % nq]
    exact = (SC * q.to(torch.float64)) @ k.to(torch.float64).transpose(-1, -2)
    assert bool(((got.logits.to(torch.float64) - exact).abs() <= got.c)[vis].all())
    p_exact = torch.softmax(exact.masked_fill(~vis, -math.inf), dim=-1).nan_to_num(0.0)
    assert bool((true_tv(p_exact, got.p64) <= got.cert + 1e-12).all())
    o_err = (got.out.to(torch.float64) - p_exact @ v.to(torch.float64)).norm(dim=-1)
    assert bool((o_err <= got.bound).all())


def test_mirror_follows_window_trims_and_evictions_and_reads_the_scratch_where_it_must() -> None:
    """Sliding-window trims drop chunks in front (incremental trim), an eviction replaces the chunk list
    (rebuild); after each the read over the codes equals the read over the scratch bit for bit. A codec the
    kernels do not decode (fp8) and a dithered store whose merged chunks lost their keys read the scratch."""
    gen = torch.Generator().manual_seed(11)
    store, _, _ = _store("int4", {}, gen, b=1, s=48)
    q = torch.randn(1, 2, 1, 32, generator=gen)
    first = code_tiles(store)[0]
    store.drop_before(20)  # drops the first 2 write blocks of 8, cuts into the third
    trimmed = code_tiles(store)[0]
    assert trimmed.offset == 4 and trimmed.codes.shape[2] == first.codes.shape[2] - 16
    _assert_poisoned_read_same(store, q)
    store2, _, _ = _store("dither-int8", {}, gen, b=1, s=48)
    keep = torch.tensor([0, 3, 4, 10, 20, 30, 40, 47]).expand(1, 2, 8).contiguous()
    store2.gather(keep)
    assert code_tiles(store2)[0].mode == MODES["scratch"]  # merged chunks carry no dither key
    store3, _, _ = _store("int8", {}, gen, b=1, s=48)
    store3.gather(keep)
    kt = code_tiles(store3)[0]
    assert kt.mode == MODES["rtn8"] and kt.offset == 0 and kt.codes.shape[2] == 8
    _assert_poisoned_read_same(store3, q)
    store4, _, _ = _store("fp8-e4m3", {}, gen, b=1, s=24)
    assert code_tiles(store4)[1].mode == MODES["scratch"]
