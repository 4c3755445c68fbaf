import math

import pytest
import torch
from bounds_stats import binomial_sf
from quant_cases import fp16_exact, ulp32, with_outlier_channels

from kvcert.bounds import tier_b_radius, tier_b_sigma2
from kvcert.quant import DitherKey, get, keyed_uniform, quantize, sample_key
from kvcert.quant.dither import DITHER_BITS
from kvcert.quant.scales import per_group


def _key(x, seed=0, layer=0, request_offset=0, position_offset=0):
    b, _, t, _ = x.shape
    return DitherKey(
        seed=seed,
        request=torch.arange(b, dtype=torch.int64) + request_offset,
        layer=layer,
        positions=(torch.arange(t, dtype=torch.int64) + position_offset).expand(b, t).contiguous(),
    )


def _normalised_residual(x, key):
    codec = get("dither-int8")
    packed = codec.encode(x, key)
    s = per_group(codec.steps(packed), 32).to(torch.float64)
    r = codec.decode(packed, key).to(torch.float64) - x.to(torch.float64)
    nz = s > 0
    return r[nz] / s[nz], x.to(torch.float64)[nz] / s[nz], packed


def test_dither_error_at_most_half_step_per_element():
    codec = get("dither-int8")
    for x in (fp16_exact(2, 2, 32, 64, seed=1), with_outlier_channels(seed=2)):
        key = sample_key(x, seed=5)
        packed = codec.encode(x, key)
        s = per_group(codec.steps(packed), 32).to(torch.float64)
        err = (codec.decode(packed, key).to(torch.float64) - x.to(torch.float64)).abs()
        assert bool((err <= s / 2 + ulp32(x)).all())


def test_dither_step_is_amax_over_126_5():
    x = fp16_exact(1, 2, 8, 64, seed=4)
    steps = get("dither-int8").encode(x, sample_key(x)).tensors["scales"].to(torch.float64)
    exact = x.unflatten(-1, (2, 32)).abs().amax(-1).to(torch.float64) / 126.5
    assert bool((steps >= exact).all()) and bool((steps <= exact * (1 + 2.0**-10)).all())


def test_dither_never_saturates_when_every_group_hits_amax():
    x = fp16_exact(4, 2, 64, 64, seed=6)
    g = x.unflatten(-1, (2, 32))
    amax = g.abs().amax(-1, keepdim=True)
    g[..., 0:1] = amax  # +amax in every group
    g[..., 1:2] = -amax  # and −amax
    x = g.flatten(-2)
    codes = get("dither-int8").encode(x, sample_key(x, seed=11)).tensors["codes"]
    assert codes.dtype == torch.int8
    assert int(codes.to(torch.int16).abs().max()) <= 127
    # and the extreme entries do reach the top of the range (the no-saturation margin is not slack)
    assert int(codes.to(torch.int16).abs().max()) >= 126


def _ks_uniform(r):
    """Kolmogorov–Smirnov distance of r + ½ from U[0, 1]."""
    u = torch.sort(r.flatten() + 0.5).values
    n = u.numel()
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    return max(float((grid - u).max()), float((u - (grid - 1.0 / n)).max()))


def test_dither_residual_is_uniform_ks():
    x = fp16_exact(4, 4, 128, 64, seed=7)
    r, _, _ = _normalised_residual(x, sample_key(x, seed=3))
    assert float(r.min()) >= -0.5 and float(r.max()) <= 0.5
    critical = 1.63 / math.sqrt(r.numel())  # KS critical value at α = 0.01
    assert _ks_uniform(r) < critical
    # the check has power: a residual 3% narrower than U[−s/2, s/2] is rejected
    assert _ks_uniform(0.97 * r) > critical


def test_dither_residual_uncorrelated_with_x():
    x = fp16_exact(4, 4, 128, 64, seed=8)
    r, xs, _ = _normalised_residual(x, sample_key(x, seed=9))
    corr = float(torch.corrcoef(torch.stack([r, xs]))[0, 1])
    assert abs(corr) < 4.0 / math.sqrt(r.numel())
    # also uncorrelated with the fractional part of x/s, which drives plain RTN's residual
    frac = xs - torch.round(xs)
    assert abs(float(torch.corrcoef(torch.stack([r, frac]))[0, 1])) < 4.0 / math.sqrt(r.numel())


@pytest.mark.parametrize("half_lambda_s", [1.5, 2.0, 3.0])
def test_dither_empirical_mgf_below_variance_proxy(half_lambda_s):
    x = fp16_exact(4, 4, 128, 64, seed=10)
    r, _, _ = _normalised_residual(x, sample_key(x, seed=12))  # r in units of s
    lam = 2.0 * half_lambda_s  # λ·s
    mgf = float(torch.exp(lam * r).mean())
    exact = math.sinh(half_lambda_s) / half_lambda_s
    assert mgf <= math.exp(lam**2 / 24.0)
    assert abs(mgf - exact) < 0.03 * exact  # and it is the uniform MGF, not just any small number


def test_same_key_regenerates_identical_decode():
    x = fp16_exact(2, 2, 16, 64, seed=13)
    codec = get("dither-int8")
    packed = codec.encode(x, _key(x, seed=1, layer=3))
    a = codec.decode(packed, _key(x, seed=1, layer=3))
    b = codec.decode(packed, _key(x, seed=1, layer=3))
    assert torch.equal(a, b)
    assert set(packed.tensors) == {"codes", "scales"}  # dither itself is never stored


@pytest.mark.parametrize(
    "other",
    [
        {"seed": 2},
        {"layer": 1},
        {"request_offset": 7},
        {"position_offset": 1},
    ],
)
def test_different_keys_give_independent_dither(other):
    x = torch.zeros(2, 2, 64, 64)
    u = keyed_uniform(_key(x), tuple(x.shape)).flatten().to(torch.float64)
    v = keyed_uniform(_key(x, **other), tuple(x.shape)).flatten().to(torch.float64)
    assert float((u == v).to(torch.float64).mean()) < 1e-3
    assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 4.0 / math.sqrt(u.numel())


def test_dither_differs_across_heads_and_channels_and_is_uniform():
    x = torch.zeros(1, 4, 32, 64)
    u = keyed_uniform(_key(x), tuple(x.shape)).to(torch.float64)
    assert float((u[:, 0] == u[:, 1]).to(torch.float64).mean()) < 1e-2
    assert float((u[..., 0] == u[..., 1]).to(torch.float64).mean()) < 1e-2
    assert float(u.min()) >= -0.5 and float(u.max()) < 0.5
    assert abs(float(u.mean())) < 4.0 * math.sqrt(1 / 12 / u.numel())
    assert abs(float(u.var()) - 1 / 12) < 0.01


def test_wrong_key_does_not_reconstruct():
    x = fp16_exact(1, 2, 16, 64, seed=14)
    codec = get("dither-int8")
    packed = codec.encode(x, _key(x, seed=1))
    s = per_group(codec.steps(packed), 32).to(torch.float64)
    err = (codec.decode(packed, _key(x, seed=2)).to(torch.float64) - x.to(torch.float64)).abs()
    assert bool((err > s / 2 + 1e-6).any())


def test_dither_needs_a_valid_key():
    x = torch.randn(2, 1, 4, 64)
    codec = get("dither-int8")
    with pytest.raises(ValueError, match="DitherKey"):
        codec.encode(x)
    bad = DitherKey(seed=0, request=torch.zeros(3, dtype=torch.int64), layer=0, positions=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="request"):
        codec.encode(x, bad)
    bad_pos = DitherKey(seed=0, request=torch.zeros(2, dtype=torch.int64), layer=0, positions=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="positions"):
        codec.encode(x, bad_pos)


def test_dither_quantize_reports_tier_b_steps():
    x = fp16_exact(1, 2, 8, 64, seed=15)
    codec = get("dither-int8")
    q = quantize(codec, x, key=sample_key(x))
    assert codec.tier_b and codec.needs_key
    assert q.steps is not None and q.steps.shape == (1, 2, 8, 2) and q.steps.dtype == torch.float32
    assert torch.equal(q.steps, q.packed.tensors["scales"].to(torch.float32))
    assert get("int8").steps(get("int8").encode(x)) is None


@pytest.mark.parametrize(("field", "value"), [("seed", 2**64), ("layer", 1.5), ("seed", True)])
def test_dither_key_scalars_validated(field, value):
    x = torch.randn(1, 1, 2, 64)
    fields = {"seed": 0, "layer": 0, field: value}
    key = DitherKey(request=torch.zeros(1, dtype=torch.int64), positions=torch.zeros(1, 2, dtype=torch.int64), **fields)
    with pytest.raises(ValueError, match=f"key.{field}"):
        get("dither-int8").encode(x, key)


@pytest.mark.parametrize("bits,divisor", [(6, 30.5), (5, 14.5), (4, 6.5), (3, 2.5)])
def test_narrow_dither_packs_real_bits_never_saturates_and_keeps_the_half_step(bits, divisor):
    """dither-int6 / -int5 / -int4 / -int3: step amax/(2^{b−1} − 1.5), codes in [−q, q] even when every group hits
    ±amax, stored bit-packed (6-bit: 48 code bytes per 64 channels), error ≤ s/2 per element, residual uniform."""
    codec = get(f"dither-int{bits}")
    q = 2 ** (bits - 1) - 1
    x = fp16_exact(4, 2, 64, 64, seed=6)
    g = x.unflatten(-1, (2, 32))
    amax = g.abs().amax(-1, keepdim=True)
    g[..., 0:1], g[..., 1:2] = amax, -amax
    x = g.flatten(-2)
    key = sample_key(x, seed=11)
    packed = codec.encode(x, key)
    assert packed.tensors["codes"].dtype == torch.uint8 and packed.tensors["codes"].shape[-1] == 64 * bits // 8
    codes = codec.codes(packed)
    assert int(codes.abs().max()) <= q and int(codes.abs().max()) >= q - 1
    steps = codec.steps(packed).to(torch.float64)
    exact = x.unflatten(-1, (2, 32)).abs().amax(-1).to(torch.float64) / divisor
    assert bool((steps >= exact).all()) and bool((steps <= exact * (1 + 2.0**-10)).all())
    s = per_group(codec.steps(packed), 32).to(torch.float64)
    r = codec.decode(packed, key).to(torch.float64) - x.to(torch.float64)
    assert bool((r.abs() <= s / 2 + ulp32(x)).all())
    nz = s > 0
    ks = _ks_uniform(r[nz] / s[nz])
    assert ks < 1.63 / math.sqrt(int(nz.sum()))


@pytest.mark.parametrize("bits", DITHER_BITS)
def test_tier_b_radius_covers_the_real_codec_at_rate_delta(bits):
    """Tier B on the codec itself (not a simulated uniform): one fixed key block with outlier channels and a fixed
    query, 4,000 independent dithers (one request id each); the read fails when any token has |ε_t| > u_t, with
    ``u = tier_b_radius(tier_b_sigma2(q, steps))``. A one-sided binomial test at p < 1e-6 must not reject
    "failure rate ≤ δ", and must reject it for u/2 (power: the test can fail)."""
    trials, s, delta, scale = 4000, 16, 0.05, 64**-0.5
    gen = torch.Generator().manual_seed(40 + bits)
    x = with_outlier_channels(1, 1, s, 64, seed=bits, channels=(3, 40))
    x = x.expand(trials, 1, s, 64).contiguous()
    q = torch.randn(64, generator=gen, dtype=torch.float64) * 3
    codec = get(f"dither-int{bits}")
    key = _key(x, seed=bits)
    packed = codec.encode(x, key)
    eps = scale * ((codec.decode(packed, key).to(torch.float64) - x.to(torch.float64)) @ q)[:, 0]  # [trials, S]
    sigma2 = tier_b_sigma2(q, codec.steps(packed)[:1, 0].to(torch.float64), scale, 32)  # steps equal over trials
    u = tier_b_radius(sigma2, s, delta)
    failures = int((eps.abs() > u).any(-1).sum())
    assert binomial_sf(failures, trials, delta) > 1e-6, failures
    too_small = int((eps.abs() > u / 2).any(-1).sum())
    assert binomial_sf(too_small, trials, delta) < 1e-6, too_small
