"""The fused pending-norm kernel per element: never below the exact norm (50-digit decimal arithmetic), within two
float32 steps of :func:`kvcert.bounds.rope.norm_up_f32` (the tensor form), non-finite rows as the tensor form
gives them, and the store's pending witnesses taken from it on CPU."""

from __future__ import annotations

from decimal import Decimal, getcontext

import numpy as np
import pytest
import torch

from kvcert.bounds.rope import norm_up_f32
from kvcert.quant.norms_numba import norms_up


def _exact_norm(row: torch.Tensor) -> Decimal:
    """``‖row‖₂`` of float64 entries (each exact as a Decimal), to 50 digits."""
    getcontext().prec = 50
    return sum((Decimal(float(x)) ** 2 for x in row.tolist()), Decimal(0)).sqrt()


def _inputs(seed: int, scale: float, dk: int, dv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 3, 4, dk, generator=g) * scale
    v = torch.randn(2, 3, 4, dv, generator=g) / scale
    c = torch.randn(2, 3, 1, dv, generator=g) / scale
    return k, v, c


def _steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many float32 steps separate non-negative finite ``a`` and ``b`` (bit patterns order as the values)."""
    return (a.view(torch.int32).to(torch.int64) - b.view(torch.int32).to(torch.int64)).abs()


@pytest.mark.parametrize("scale", [1e-30, 1e-6, 1.0, 3e2, 1e6, 1e18])
@pytest.mark.parametrize(("dk", "dv"), [(64, 64), (128, 32), (3, 5)])
def test_never_below_the_exact_norm_and_within_two_steps_of_the_tensor_form(scale, dk, dv):
    k, v, c = _inputs(int(scale > 1) + dk, scale, dk, dv)
    got = norms_up(k, v, c)
    diff = v.to(torch.float64) - c  # the float64 difference both forms take the norm of
    for out, x in zip(got, (k.to(torch.float64), v.to(torch.float64), diff), strict=True):
        assert out.dtype == torch.float32 and out.shape == x.shape[:3]
        ref = norm_up_f32(x)
        assert int(_steps_apart(out, ref).max()) <= 2
        for idx in np.ndindex(*x.shape[:3]):
            assert Decimal(float(out[idx])) >= _exact_norm(x[idx]), idx  # never below, per element


def test_would_catch_a_norm_rounded_to_nearest():
    """The exact comparison above is not vacuous: the norms rounded to nearest float32 fall below the exact norm for
    some entries of the same inputs."""
    k, _, _ = _inputs(1, 1.0, 64, 64)
    nearest = k.to(torch.float64).norm(dim=-1).to(torch.float32)
    below = [idx for idx in np.ndindex(*k.shape[:3]) if Decimal(float(nearest[idx])) < _exact_norm(k[idx].double())]
    assert below


def test_non_finite_rows_give_what_the_tensor_form_gives():
    k, v, c = _inputs(3, 1.0, 64, 64)
    k[0, 0, 0, 5], k[0, 1, 0, 7] = float("inf"), float("nan")
    v[1, 2, 3, 0] = float("-inf")
    v[1, 2, 3, 1] = float("inf")  # inf and -inf: the difference from the centre stays infinite, no NaN
    v[0, 2, 1, 4] = float("nan")
    got = norms_up(k, v, c)
    v64 = v.to(torch.float64)
    for out, ref in zip(got, (norm_up_f32(k), norm_up_f32(v), norm_up_f32(v64 - c)), strict=True):
        assert torch.equal(out.isnan(), ref.isnan())
        assert torch.equal(out.isinf(), ref.isinf())
        fin = out.isfinite()
        assert int(_steps_apart(out[fin], ref[fin]).max()) <= 2
    assert got[0][0, 0, 0] == float("inf") and got[0][0, 1, 0].isnan() and got[1][1, 2, 3] == float("inf")


def test_flat_rows_with_a_centre_per_row_equal_the_batched_call():
    """The persistent-repair form (rows gathered from several heads, each with its head's centre) gives each row
    what the ``[B, H, T, D]`` call gives it."""
    k, v, c = _inputs(5, 1.0, 64, 64)
    batched = norms_up(k, v, c)
    flat = norms_up(k.reshape(-1, 64), v.reshape(-1, 64), c.expand(v.shape).reshape(-1, 64))
    for a, b in zip(batched, flat, strict=True):
        assert torch.equal(a.reshape(-1), b)


def test_bad_inputs_are_named():
    k, v, c = _inputs(0, 1.0, 64, 64)
    with pytest.raises(ValueError, match="float32 k"):
        norms_up(k.double(), v, c)
    with pytest.raises(ValueError, match="centre"):
        norms_up(k, v, c[..., :5])
    with pytest.raises(ValueError, match="leading"):
        norms_up(k, v[:, :, :2], c)


def test_inputs_that_require_grad_are_read_as_their_values():
    """A store built outside ``torch.no_grad`` holds a centre (and gets entries) that require grad: same norms."""
    k, v, c = _inputs(4, 1.0, 64, 64)
    want = norms_up(k, v, c)
    got = norms_up(k.requires_grad_(), v.requires_grad_(), c.requires_grad_())
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
