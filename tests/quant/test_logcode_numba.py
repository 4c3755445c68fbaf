"""The fused CPU plan of a log8 witness write (:mod:`kvcert.quant.logcode_numba`) equals the tensor path element by
element: exponents (those of the exact search), bases, shifts, codes, decoded values, rebase count and the
encoder's fail-closed check, on random and adversarial values (codes' own values and their float neighbours, zeros,
NaN, infinities, negatives, values beyond float32, subnormals) against unset, low and high bases."""

from __future__ import annotations

import math

import pytest
import torch

from kvcert.cache.buffer import LogBuffer
from kvcert.checks import Checks, deferred
from kvcert.quant import logcode, logcode_numba


def _values(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float64 witnesses over the whole code range: random magnitudes, codes' own values and their neighbours."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(shape, dtype=torch.float64).uniform_(-140.0, 140.0, generator=gen))
    n = torch.randint(logcode.MIN_N, logcode.MAX_N + 1, shape, generator=gen, dtype=torch.int32)
    own = logcode.dec(n).to(torch.float64)
    pick = torch.randint(0, 4, shape, generator=gen)
    x = torch.where(pick == 0, mag, own)
    x = torch.where(pick == 2, torch.nextafter(own, torch.tensor(math.inf, dtype=torch.float64)), x)
    x = torch.where(pick == 3, torch.nextafter(own, torch.tensor(0.0, dtype=torch.float64)), x)
    return x


def _adversarial(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zeros, NaN, +inf, a value beyond ``dec(MAX_N)``, the largest float32, a float64 subnormal and the
    smallest positive float32 planted in its first head."""
    x = x.clone()
    flat = x[0, 0].reshape(-1)
    planted = [0.0, math.nan, math.inf, 1e300, float(torch.finfo(torch.float32).max), 5e-324, 1.4e-45, 0.0]
    flat[: len(planted)] = torch.tensor(planted, dtype=torch.float64)
    x[0, 0] = flat.view(x[0, 0].shape)
    return x


def _tensor_plan(buf: LogBuffer, x: torch.Tensor, base: torch.Tensor, index=None):
    """The tensor path's plan (exponents of the exact search) and its encoder check's flag (True: failed)."""
    checks = Checks()
    with deferred(checks):
        p = buf._plan(x, logcode.exponent_up(x), torch.zeros((), dtype=torch.bool), index, base)
    ((bad, _),) = checks._checks
    return p, bool(bad)


def _bases(kind: str, shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    if kind == "unset":
        return torch.full(shape, logcode.UNSET, dtype=torch.int32)
    lo, hi = (logcode.MIN_N, -1000) if kind == "low" else (0, logcode.MAX_N - logcode.TOP)
    base = torch.randint(lo, hi, shape, generator=gen, dtype=torch.int32)
    base[0, 0] = logcode.UNSET  # a mix of unset and set heads
    return base


@pytest.mark.parametrize("kind", ["unset", "low", "high"])
@pytest.mark.parametrize(("seed", "tail"), [(0, (4,)), (1, ()), (2, (8,))])
def test_fused_plan_equals_the_tensor_plan_per_element(kind, seed, tail):
    shape = (2, 3, 7, *tail)
    x = _adversarial(_values(seed, shape)) if seed != 1 else _values(seed, shape)
    base = _bases(kind, (2, 3), torch.Generator().manual_seed(100 + seed))
    buf = LogBuffer(torch.zeros(2, 3, 0, *tail))
    ref, ref_bad = _tensor_plan(buf, x, base)
    got = logcode_numba.plan(x, None, base)
    assert torch.equal(got.n, ref.n)
    assert torch.equal(got.base, ref.base) and torch.equal(got.shift, ref.shift)
    assert got.rebased == int((ref.shift > 0).sum()) == int(ref.summary[1])
    assert not (got.negative or got.above_top or ref_bad)
    assert torch.equal(got.codes, ref.codes)
    spread = ref.base.view(2, 3, *([1] * (len(shape) - 2))).expand(shape)
    assert torch.equal(got.decoded, logcode.decode(ref.codes, spread))
    assert (got.decoded.to(torch.float64) >= torch.nan_to_num(x, nan=math.inf)).all()  # never below the value


def test_fused_plan_of_an_indexed_write_equals_the_tensor_plan():
    """A write at a boolean token mask of one head and at a strided token slice: same plan as the tensor path."""
    gen = torch.Generator().manual_seed(3)
    buf = LogBuffer(torch.zeros(2, 3, 0))
    buf.append(torch.rand(2, 3, 10, generator=gen, dtype=torch.float64) * 4)
    for index in ((1, 2, torch.arange(10) % 3 == 0), (slice(None), 1, slice(0, 10, 2))):
        target = buf.codes.view()[index]
        x = torch.rand(target.shape, generator=gen, dtype=torch.float64) * 1e6  # raises the written head's base
        ref, _ = _tensor_plan(buf, x, buf.base, index)
        heads = buf._spread(torch.arange(6).view(2, 3), index, x)
        got = logcode_numba.plan(x, heads, buf.base)
        assert torch.equal(got.codes, ref.codes) and torch.equal(got.base, ref.base)
        assert torch.equal(got.shift, ref.shift) and got.rebased > 0
        assert torch.equal(got.decoded, logcode.decode(ref.codes, buf._spread(ref.base, index, x)))


@pytest.mark.parametrize("bad", [-1.0, -math.inf])
def test_fused_plan_flags_a_negative_witness(bad):
    x = torch.rand(1, 2, 3, dtype=torch.float64)
    x[0, 1, 2] = bad
    base = torch.full((1, 2), logcode.UNSET, dtype=torch.int32)
    got = logcode_numba.plan(x, None, base)
    _, ref_bad = _tensor_plan(LogBuffer(torch.zeros(1, 2, 0)), x, base)
    assert got.negative and ref_bad
