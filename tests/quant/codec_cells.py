"""Adversarial end-to-end cells for a key codec + its Tier-A witness (shared by ``tests/quant`` and
``benchmarks/soundness_fuzz.py``).

A cell is one read: keys ``k[S, D]`` (Gaussian with a random overall scale over three orders of magnitude, fp16-exact,
sometimes with outlier channels or a massive sink token), encoded and decoded by the codec; the witness is the
band norms of the residual ``Δ = k̂ − k`` over whole RoPE pairs (what the store keeps); the query is built
against it: the Cauchy–Schwarz equality direction band by band for one token (``q_b ∝ Δ_{j,b}``, positive
weights, where the radius is exact up to rounding), the same for a sum of tokens, a random direction, or a
mix, scaled so that logits range from tiny to saturated. Per cell: radii ``c_t`` (Tier A, rounded up), the
realised logit errors ``ε_t = sc·q·Δ_t``, the served distribution ``softmax(sc·q·k̂)`` and the exact
``softmax(sc·q·k)`` (float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcert.bounds import band_norms, tier_a_radius, true_tv, tv_meter
from kvcert.quant import QuerySubspaceWitness, get, logcode, sample_key

F64 = torch.float64
CODEC_FORMS: tuple[str, ...] = ("hadamard-int4", "hadamard-int2")
#: (codec, witness storage) forms whose Tier-A band norms go through the compact log8 code before the radius
WITNESS_FORMS: tuple[tuple[str, str], ...] = (
    ("dither-int8", "log8"),
    ("dither-int6", "log8"),
    ("dither-int4", "log8"),
    ("dither-int3", "log8"),
)
#: (S, cells) per chunk for the witness forms: short reads (the code acts per token and band; the dither hash
#: costs per element), one round is 10^5 cells
WITNESS_PLAN: tuple[tuple[int, int], ...] = ((2, 60_000), (4, 30_000), (8, 10_000))
#: (key codec, witness bits) of the query-subspace witness forms (``docs/math.md#query-subspace-witness``)
QSW_FORMS: tuple[tuple[str, int], ...] = (("hadamard-int4", 8), ("hadamard-int4", 4))
#: basis ranks the query-subspace cells draw from (one per chunk), 1 to D − 1 at D = 64; 4-bit codes take the even ones
QSW_RANKS: tuple[int, ...] = (1, 2, 16, 32, 63)
#: (S, cells) per chunk for the codec forms; one round is 10^5 cells
CODEC_PLAN: tuple[tuple[int, int], ...] = ((4, 60_000), (16, 30_000), (64, 8_000), (256, 2_000))
SLACK = 1e-12


@dataclass(frozen=True)
class CodecCells:
    radius: torch.Tensor  # [n, S] Tier-A radii
    eps: torch.Tensor  # [n, S] realised logit errors
    meter: torch.Tensor  # [n] meter(p̃, c)
    tv: torch.Tensor  # [n] TV(exact, served)


def adversarial_keys(n: int, s: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` fp16-exact key sets ``[n, s, d]`` (module doc): Gaussian over three orders of magnitude, half with three
    outlier channels, 30 % with a sink token."""
    x = torch.randn(n, s, d, generator=gen)
    x *= 10.0 ** (3 * torch.rand(n, 1, 1, generator=gen) - 2)
    outliers = torch.rand(n, 1, 1, generator=gen) < 0.5
    chans = torch.randint(0, d, (n, 1, 3), generator=gen).expand(n, s, 3)
    boost = torch.where(outliers, 30.0 * torch.rand(n, 1, 1, generator=gen) + 1.0, torch.ones(n, 1, 1))
    x.scatter_(-1, chans, x.gather(-1, chans) * boost.expand(n, s, 3))
    sink = torch.rand(n, generator=gen) < 0.3
    x[:, 0] *= torch.where(sink, 20.0, 1.0).view(n, 1)
    return x.clamp(-60_000.0, 60_000.0).to(torch.float16).to(torch.float32)


def log8_stored(rho: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``rho[n, ...] >= 0`` as a :class:`~kvcert.cache.buffer.LogBuffer` would serve it: rounded up to float32,
    encoded against one base per cell and decoded. The base is drawn adversarially in ``[m − 253, m + 30]``
    codes around the cell's largest exponent ``m`` (from "the largest value takes the top code" to "every value
    is clamped up to the base", as after a large rebase)."""
    r32 = rho.to(torch.float32)
    r32 = torch.where(r32.to(F64) < rho, torch.nextafter(r32, torch.full_like(r32, float("inf"))), r32)
    need = logcode.exponent_up(r32).flatten(1).amax(-1)  # [n]
    base = need - (logcode.TOP - 1) + torch.randint(0, logcode.TOP + 30, need.shape, generator=gen, dtype=torch.int32)
    base = base.view(-1, *([1] * (rho.dim() - 1)))
    return logcode.decode(logcode.encode(r32, base), base).to(F64)


def make_codec_cells(
    codec: str, n: int, s: int, gen: torch.Generator, d: int = 64, bands: int = 8, witness: str = "f32"
) -> CodecCells:
    """``n`` adversarial cells of ``s`` tokens for ``codec`` (see the module docstring); ``witness="log8"`` serves
    the band norms through :func:`log8_stored` (what the store's compact witnesses hold)."""
    x = adversarial_keys(n, s, d, gen)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    c = get(codec, seed=seed) if codec.startswith("hadamard") else get(codec)
    key = sample_key(x[None], seed) if c.needs_key else None
    k_hat = c.decode(c.encode(x[None], key), key)[0].to(F64)
    k = x.to(F64)
    delta = k_hat - k
    rho = band_norms(delta, bands)  # [n, S, B]
    if witness == "log8":
        rho = log8_stored(rho, gen)
    # query: CS-equality direction for one token j (positive per-band weights), for a sum of tokens, random, or a mix
    j = torch.randint(0, s, (n,), generator=gen)
    dj = delta[torch.arange(n), j]  # [n, D]
    w = torch.rand(n, bands, generator=gen, dtype=F64) + 0.01
    dj_hat = dj.unflatten(-1, (2, bands, d // (2 * bands)))  # rotate_half bands
    norm_b = dj_hat.square().sum((-3, -1), keepdim=True).sqrt().clamp(min=1e-300)
    aligned = (dj_hat / norm_b * w.view(n, 1, bands, 1)).flatten(-3)
    summed = delta.sum(1)
    rnd = torch.randn(n, d, generator=gen, dtype=F64)
    kind = torch.randint(0, 4, (n, 1), generator=gen)
    mix = torch.rand(n, 1, generator=gen, dtype=F64)

    q = torch.where(
        kind == 0,
        _unit(aligned),
        torch.where(
            kind == 1,
            _unit(summed),
            torch.where(kind == 2, _unit(rnd), _unit(mix * _unit(aligned) + (1 - mix) * _unit(rnd))),
        ),
    )
    q = q * (10.0 ** (4 * torch.rand(n, 1, generator=gen, dtype=F64) - 1)) / k.norm(dim=-1).amax(-1, keepdim=True)
    q = q.to(torch.float32).to(F64)  # a float32 query
    return _read(q, k, k_hat, tier_a_radius(q, rho, d**-0.5))


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm(dim=-1, keepdim=True).clamp(min=1e-300)


def _read(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor, radius: torch.Tensor) -> CodecCells:
    """The cells of queries ``q[n, D]`` over exact keys ``k`` and served keys ``k_hat`` ``[n, S, D]`` (float64), with
    the radii ``radius[n, S]`` of those queries: logit errors, meter and exact TV."""
    sc = k.shape[-1] ** -0.5
    served = sc * torch.einsum("nd,nsd->ns", q, k_hat)
    exact = sc * torch.einsum("nd,nsd->ns", q, k)
    p_served, p_exact = torch.softmax(served, -1), torch.softmax(exact, -1)
    return CodecCells(radius, served - exact, tv_meter(p_served, radius), true_tv(p_exact, p_served))


def make_qsw_cells(codec: str, bits: int, n: int, s: int, gen: torch.Generator, d: int = 64) -> CodecCells:
    """``n`` adversarial cells of ``s`` tokens for ``codec`` with a query-subspace witness at ``bits`` bits
    (:class:`~kvcert.quant.QuerySubspaceWitness`). Each cell has its own basis ``U[D, k]`` (``k`` drawn per chunk
    from :data:`QSW_RANKS`, even at 4 bits): orthonormal (QR of a Gaussian), in a quarter of the cells with its
    first column along the residual ``Δ_j`` of the aimed token ``j``, in another quarter with columns rescaled by up
    to ±50 % (not orthonormal: the radius must hold for any ``U``). The query is the equality direction of the last term
    (``q ∝ Δ_j − UUᵀΔ_j``), a direction inside the span (``U UᵀΔ_j``), their sum, ``Δ_j`` itself, or random."""
    x = adversarial_keys(n, s, d, gen)
    c = get(codec, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    k_hat = c.decode(c.encode(x[None]))[0].to(F64)
    k = x.to(F64)
    delta = k_hat - k
    j = torch.randint(0, s, (n,), generator=gen)
    dj = delta[torch.arange(n), j]  # [n, D]
    ranks = [r for r in QSW_RANKS if bits == 8 or r % 2 == 0]
    rank = ranks[int(torch.randint(0, len(ranks), (1,), generator=gen))]
    raw = torch.randn(n, d, rank, generator=gen, dtype=F64)
    along = torch.rand(n, generator=gen) < 0.25
    raw[:, :, 0] = torch.where(along.view(n, 1), dj, raw[:, :, 0])
    u = torch.linalg.qr(raw).Q
    skew = (torch.rand(n, generator=gen) < 0.25).view(n, 1, 1)
    u = torch.where(skew, u * (1 + 0.5 * (2 * torch.rand(n, 1, rank, generator=gen, dtype=F64) - 1)), u)
    u = u.to(torch.float32)
    witness = QuerySubspaceWitness(u, bits)
    packed = witness.encode(x[None], k_hat[None].to(torch.float32))
    u64 = u.to(F64)
    inside = (u64 @ (u64.transpose(-1, -2) @ dj.unsqueeze(-1))).squeeze(-1)
    kind = torch.randint(0, 5, (n, 1), generator=gen)
    options = torch.stack([_unit(dj - inside), _unit(inside), _unit(_unit(dj - inside) + _unit(inside)), _unit(dj)])
    rnd = _unit(torch.randn(n, d, generator=gen, dtype=F64))
    q = torch.where(kind < 4, options[kind.clamp(max=3).squeeze(-1), torch.arange(n)], rnd)
    q = q * (10.0 ** (4 * torch.rand(n, 1, generator=gen, dtype=F64) - 1)) / k.norm(dim=-1).amax(-1, keepdim=True)
    q = q.to(torch.float32).to(F64)  # a float32 query
    radius = witness.radius(packed, q[None, :, None, :], d**-0.5)[0, :, 0]  # [n, S]
    return _read(q, k, k_hat, radius)


def violations(cells: CodecCells) -> tuple[int, int]:
    """``(radius violations, meter violations)``: ``|ε_t| > c_t`` per token (relative 1e-12 for the float64
    evaluation of the two dot products) and ``meter + SLACK < TV`` per cell."""
    radius_bad = cells.eps.abs() > cells.radius * (1 + 1e-12) + 1e-300
    return int(radius_bad.sum()), int((cells.meter + SLACK < cells.tv).sum())


def adversarial_witnesses(n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` non-negative float32 values stressing the log8 code: uniform random bit patterns over every
    finite non-negative float32 (denormals included), exact code boundaries ``dec(m)`` and their float32
    neighbours, powers of two, 0, the float32 extremes, ``+inf`` and NaN."""
    bits = torch.randint(0, 0x7F800000, (n,), generator=gen, dtype=torch.int32).view(torch.float32)
    m = torch.randint(logcode.MIN_N, logcode.MAX_N + 1, (n,), generator=gen, dtype=torch.int32)
    edge = logcode.dec(m)
    up, down = torch.nextafter(edge, torch.tensor(float("inf"))), torch.nextafter(edge, torch.tensor(0.0))
    special = torch.tensor(
        [0.0, 1e-45, 1.1754942e-38, 1.1754944e-38, 1.0, 2.0, 3.4028235e38, float("inf"), float("nan")]
    )
    pick = torch.randint(0, 6, (n,), generator=gen)
    pow2 = torch.ldexp(torch.ones(n), torch.randint(-149, 128, (n,), generator=gen)).to(torch.float32)
    spec = special[torch.randint(0, len(special), (n,), generator=gen)]
    return torch.stack([bits, edge, up, down, pow2, spec])[pick, torch.arange(n)]


def witness_element_violations(x: torch.Tensor, gen: torch.Generator) -> tuple[int, float]:
    """Encode ``x`` against random bases that fit its largest value's code (as the buffer guarantees), decode,
    and return ``(violations, worst decoded/x over values at or above their base)``: a violation is a decoded
    value below ``x``, a NaN, or NaN/``+inf`` not decoded to ``+inf``."""
    n = logcode.exponent_up(x)
    finite_pos = torch.isfinite(x) & (x > 0) & (n <= logcode.MAX_N)
    base = torch.randint(logcode.MIN_N, logcode.MAX_N + 1, x.shape, generator=gen, dtype=torch.int32)
    base = torch.where(finite_pos, torch.minimum(base, n), base)  # fits: code n - base + 1 in [1, TOP]
    base = torch.where(finite_pos, torch.maximum(base, n - (logcode.TOP - 1)), base)
    y = logcode.decode(logcode.encode(x, base), base)
    nonfinite = torch.isnan(x) | torch.isinf(x)
    bad = torch.isnan(y) | (y.to(F64) < x.to(F64)) | (nonfinite & ~torch.isinf(y))
    above = finite_pos & (x.to(F64) >= logcode.dec(base).to(F64))  # not clamped up to the base
    ratio = (y.to(F64) / x.to(F64))[above]
    return int(bad.sum()), float(ratio.max()) if ratio.numel() else 0.0
