"""The fused pending-witness kernel (:mod:`kvcert.quant.pending_numba`) per element: the norms of
:func:`kvcert.quant.norms_up` planned by :func:`kvcert.quant.logcode_numba.plan` against each buffer's bases, bit for
bit, and ``None`` exactly where such a plan would change a base or fail its check."""

from __future__ import annotations

import math

import pytest
import torch

from kvcert.quant import logcode, logcode_numba
from kvcert.quant.norms_numba import norms_up
from kvcert.quant.pending_numba import held_codes, pending_codes


def _inputs(seed: int, t: int, scale: float, dv: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 3, t, 64, generator=g) * scale
    v = torch.randn(2, 3, t, dv, generator=g) / scale
    c = torch.randn(2, 3, 1, dv, generator=g) / scale
    return k, v, c


def _reference(k, v, c, bases):
    """``(codes, decoded, ok)`` from the one-by-one kernels: norms_up, then plan per buffer."""
    plans = [logcode_numba.plan(n, None, b) for n, b in zip(norms_up(k, v, c), bases, strict=True)]
    ok = all(not (p.negative or p.above_top) and torch.equal(p.base, b) for p, b in zip(plans, bases, strict=True))
    return torch.stack([p.codes for p in plans]), torch.stack([p.decoded for p in plans]), ok


def _settled_bases(k, v, c):
    """Bases that the norms of ``k, v`` fit without change (those a first write of them sets)."""
    return tuple(
        logcode_numba.plan(n, None, torch.full((2, 3), logcode.UNSET, dtype=torch.int32)).base
        for n in norms_up(k, v, c)
    )


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("scale", [1e-6, 1.0, 3e2])
@pytest.mark.parametrize("dv", [64, 32])
def test_codes_and_decoded_values_are_those_of_the_one_by_one_kernels(t, scale, dv):
    k, v, c = _inputs(t + dv, t, scale, dv)
    bases = _settled_bases(k * 2, v * 2, c)  # set from larger values: every norm fits below the top code
    got = pending_codes(k, v, c, bases)
    codes, decoded, ok = _reference(k, v, c, bases)
    assert ok and got is not None
    assert torch.equal(torch.from_numpy(got[0]), codes)
    assert torch.equal(torch.from_numpy(got[1]).view(torch.int32), decoded.view(torch.int32))
    for d, n in zip(torch.from_numpy(got[1]), norms_up(k, v, c), strict=True):
        assert (d >= n).all()  # decoded upwards: never below the norm written


def test_a_strided_value_and_a_full_centre_give_the_same_codes():
    k, v, c = _inputs(7, 3, 1.0)
    wide = torch.randn(2, 3, 3, 128)
    wide[..., ::2] = v
    full = c.expand(v.shape).contiguous()
    bases = _settled_bases(k * 2, v * 2, c)
    got, ref = pending_codes(k, wide[..., ::2], full, bases), pending_codes(k, v, c, bases)
    assert got is not None and ref is not None
    assert (got[0] == ref[0]).all() and (got[1] == ref[1]).all()


@pytest.mark.parametrize("case", ["unset", "above_top", "nonfinite"])
def test_none_exactly_where_a_plan_changes_a_base(case):
    """An unset base (a first positive write) and a norm above its head's top code change a base: ``None``, as the
    one-by-one plan says. A NaN / inf entry is stored as the infinity code and changes nothing."""
    k, v, c = _inputs(11, 2, 1.0)
    bases = _settled_bases(k * 2, v * 2, c)
    if case == "unset":
        bases = (bases[0], bases[1].clone(), bases[2])
        bases[1][1, 2] = logcode.UNSET
    elif case == "above_top":
        k = k.clone()
        k[0, 1, 1] *= 2.0**40
    else:
        v = v.clone()
        v[1, 0, 0, 3] = math.nan
        k = k.clone()
        k[0, 2, 1, 0] = math.inf
    got = pending_codes(k, v, c, bases)
    codes, decoded, ok = _reference(k, v, c, bases)
    assert ok == (case == "nonfinite") == (got is not None)
    if got is not None:
        assert torch.equal(torch.from_numpy(got[0]), codes) and (codes == logcode.INF_CODE).any()
        assert torch.equal(torch.from_numpy(got[1]).view(torch.int32), decoded.view(torch.int32))


def test_bad_input_is_refused():
    k, v, c = _inputs(1, 1, 1.0)
    bases = _settled_bases(k, v, c)
    with pytest.raises(ValueError, match="float32 k"):
        pending_codes(k.double(), v, c, bases)
    with pytest.raises(ValueError, match="int32"):
        pending_codes(k, v, c, (bases[0].long(), bases[1], bases[2]))
    with pytest.raises(ValueError, match="T >= 1"):
        pending_codes(k[:, :, :0], v[:, :, :0], c, bases)
    with pytest.raises(ValueError, match="does not broadcast"):
        pending_codes(k, v, c[..., :5], bases)


def test_held_codes_at_scattered_places_are_those_of_the_indexed_plans():
    """Rows at scattered (row, head) places: the norms of ``norms_up`` planned with those heads, bit for bit, and
    ``None`` where a head's base would rise."""
    k, v, c = _inputs(5, 4, 1.0)
    bases = _settled_bases(k * 2, v * 2, c)
    where = (torch.tensor([0, 1, 1, 0, 1]), torch.tensor([2, 0, 2, 2, 1]), torch.tensor([3, 0, 1, 1, 2]))
    kr, vr, cr = k[where], v[where], c.expand(v.shape)[where]
    heads = where[0] * 3 + where[1]
    got = held_codes(kr.numpy(), vr.numpy(), cr.contiguous().numpy(), heads.numpy(), tuple(b.numpy() for b in bases))
    assert got is not None
    for w, (n, b) in enumerate(zip(norms_up(kr, vr, cr), bases, strict=True)):
        ref = logcode_numba.plan(n, heads, b)
        assert torch.equal(ref.base, b) and torch.equal(torch.from_numpy(got[0][w]), ref.codes)
        assert torch.equal(torch.from_numpy(got[1][w]).view(torch.int32), ref.decoded.view(torch.int32))
    kr[2] *= 2.0**40
    args = (vr.numpy(), cr.contiguous().numpy(), heads.numpy(), tuple(b.numpy() for b in bases))
    assert held_codes(kr.numpy(), *args) is None
    with pytest.raises(ValueError, match="held_codes"):
        held_codes(kr.numpy(), args[0], args[1], heads.numpy() + 6, args[3])  # a head beyond the bases
    with pytest.raises(ValueError, match="held_codes"):
        held_codes(kr.numpy(), args[0], args[1][:, :5], *args[2:])
