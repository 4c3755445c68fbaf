"""``log8``: an 8-bit logarithmic code for non-negative witnesses that never decodes below the true value
(``docs/math.md#compact-witnesses``).

A code ``c`` is read against an integer *base exponent* ``e`` (one per (row, KV head) of a buffer):

* ``c = 0``        ↔ exactly ``0`` (residual-free entries keep a radius of exactly 0);
* ``1 ≤ c ≤ 254``  ↔ ``dec(e + c − 1)`` with ``dec(n) = F[n mod 16] · 2^⌊n/16⌋`` and ``F[k] = 2^{k/16}`` rounded
  *up* to float32, so ``dec(n) ≥ 2^{n/16}`` and ``dec`` is strictly increasing;
* ``c = 255``      ↔ ``+inf`` (fail closed: only for values beyond float32's range, NaN or ``+inf``).

Decoding is exact float32 arithmetic (a table entry times a power of two built from its bits), hence
bit-identical on every device. Encoding picks the *smallest* ``n`` with ``dec(n) ≥ x`` by a float64 ``log2``
guess corrected with exact comparisons against ``dec`` itself, so ``decode(encode(x)) ≥ x`` never depends on the
accuracy of ``log2``. Values below the base decode to the base ``dec(e)`` (still ``≥ x``). The relative
overestimate of a value at or above the base is below ``2^{1/16} − 1 < 4.5%`` (plus one float32 ulp of ``F``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvcert.checks import fail_if

SUB = 16  # codes per octave
TOP = 254  # largest finite code
INF_CODE = 255
MIN_N = -126 * SUB  # dec(n) is a normal float32 for MIN_N <= n <= MAX_N
MAX_N = 128 * SUB - 1
HEADROOM = 10 * SUB  # a new base sits 10 octaves below the largest value of its first write
UNSET = torch.iinfo(torch.int32).min  # base exponent of a head that has only seen zeros

# F[k] = 2^(k/16) rounded up to float32 (float64 value, then one ulp up where rounding went down)
_F64 = [2.0 ** (k / SUB) for k in range(SUB)]
_F32 = np.array(_F64, dtype=np.float32)
_F32 = np.where(_F32.astype(np.float64) < np.array(_F64), np.nextafter(_F32, np.float32(np.inf)), _F32)
FRACTIONS = torch.from_numpy(_F32.astype(np.float32))


def dec(n: torch.Tensor) -> torch.Tensor:
    """``dec(n) = F[n mod 16]·2^⌊n/16⌋`` as float32 for int ``n`` (``MIN_N ≤ n ≤ MAX_N``: exact, normal)."""
    n = n.to(torch.int32)
    octave = torch.div(n, SUB, rounding_mode="floor")
    pow2 = ((octave + 127) << 23).view(torch.float32)  # exactly 2^octave for octave in [-126, 127]
    return FRACTIONS.to(n.device)[(n - octave * SUB).long()] * pow2


#: correction rounds :func:`exponent_settle` makes without waiting for the device. The float64 ``log2`` guess is
#: off by far less than one code (``dec`` exceeds ``2^{n/16}`` by at most a float32 ulp), so two rounds settle
#: every entry in practice; the exact comparisons against ``dec`` still decide, and :func:`exponent_up` keeps
#: stepping when an entry is not settled.
SETTLE_ROUNDS = 2


def _step(x64: torch.Tensor, ok: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One correction round of :func:`exponent_up`: ``(n', unsettled)``. An entry is either too low (``dec(n) <
    x``: step up) or too high (``dec(n − 1) ≥ x``: step down), never both (``dec`` is increasing), and the ``n``
    with neither is unique (the smallest ``n`` in ``[MIN_N, MAX_N + 1]`` with ``dec(n) ≥ x``); ``unsettled`` marks
    the entries that moved."""
    low = ok & (n <= MAX_N) & (dec(n.clamp(max=MAX_N)).to(torch.float64) < x64)
    high = ok & (n > MIN_N) & (dec((n - 1).clamp(MIN_N, MAX_N)).to(torch.float64) >= x64)
    return n + low.to(torch.int32) - high.to(torch.int32), low | high


def exponent_settle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`exponent_up` without waiting for the device: the float64 ``log2`` guess corrected by
    :data:`SETTLE_ROUNDS` rounds, and a 0-dim bool tensor, True when some entry may still be off (it moved in the
    last round). When it is False, the result equals :func:`exponent_up`'s; the caller reads it back together
    with whatever else it has to read (one sync) and falls back to :func:`exponent_up` when it is True."""
    x64 = x.to(torch.float64)
    ok = torch.isfinite(x64) & (x64 > 0)
    guess = torch.ceil(SUB * torch.log2(torch.where(ok, x64, 1.0)))
    n = guess.clamp(MIN_N, MAX_N + 1).to(torch.int32)
    moved = torch.zeros_like(ok)
    for _ in range(SETTLE_ROUNDS + 1):  # the last round only checks: an entry that moves is not settled
        n, moved = _step(x64, ok, n)
    return torch.where(ok, n, MIN_N), moved.any()


def exponent_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest int ``n`` with ``dec(n) ≥ x`` for positive finite ``x`` (int32, clamped to ``[MIN_N,
    MAX_N + 1]``; ``MAX_N + 1`` means no finite ``dec`` is large enough). Other entries give ``MIN_N``.

    The exact comparisons against ``dec`` (not ``log2``) decide the result: :func:`exponent_settle`, then further
    correction rounds until no entry moves (one wait for the device per round)."""
    n, unsettled = exponent_settle(x)
    x64 = x.to(torch.float64)
    ok = torch.isfinite(x64) & (x64 > 0)
    while bool(unsettled):
        n, moved = _step(x64, ok, n)
        unsettled = moved.any()
    return n


def initial_base(n_max: torch.Tensor) -> torch.Tensor:
    """Base exponent for a head whose first positive write needs exponent ``n_max``: ``HEADROOM`` codes below
    it (values down to ~1/1024 of the first maximum keep their precision; up to ~56× above it fit)."""
    return (n_max - HEADROOM).clamp(min=MIN_N)


def encode_checked(x: torch.Tensor, base: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Codes (uint8) of ``x`` against ``base`` given ``n = exponent_up(x)``, valid only when no entry is negative
    and no finite entry needs a code above ``TOP``: the two fail-closed checks are one
    :func:`kvcert.checks.fail_if` (``ValueError``, the negative entry's first), so they wait for the device once
    here, or not at all inside the caller's :func:`kvcert.checks.deferred` block (read back with its other checks;
    code after a failed one runs on invalid codes, which the caller must not store)."""
    beyond = torch.isnan(x) | torch.isinf(x) | (n > MAX_N)
    code = (n.to(torch.int64) - base.to(torch.int64) + 1).clamp(min=1)
    finite_pos = (x > 0) & ~beyond
    check_codes(x, (x < 0).any(), (finite_pos & (code > TOP)).any())
    code = torch.where(finite_pos, code, 0)
    return torch.where(beyond, INF_CODE, code).to(torch.uint8)


def check_codes(x: torch.Tensor, negative: torch.Tensor, above_top: torch.Tensor) -> None:
    """The encoder's fail-closed check of the witnesses ``x``, one :func:`kvcert.checks.fail_if` (``ValueError``):
    ``negative`` (0-dim bool: some entry is negative; reported first) or ``above_top`` (some finite entry needs a
    code above ``TOP`` against its base)."""

    def error() -> ValueError:
        if bool(negative):
            return ValueError(f"witnesses must be non-negative, got min {float(x.min())}")
        return ValueError("a witness exceeds the top code of its base; rebase the buffer before encoding")

    fail_if(negative | above_top, error)


def encode(x: torch.Tensor, base: torch.Tensor, n: torch.Tensor | None = None) -> torch.Tensor:
    """Codes (uint8) of non-negative ``x`` against base exponents ``base`` (int32, broadcast to ``x``).

    ``0 → 0``; positive finite ``x`` → ``clamp(n − base + 1, 1, ·)`` with ``n = exponent_up(x)``; NaN, ``+inf``
    and values beyond float32 → ``INF_CODE``. Raises ``ValueError`` on negative entries and when a finite
    value needs a code above ``TOP`` (the caller raises ``base`` first: :func:`rebase`). ``n``: ``exponent_up(x)``
    when the caller has it already (saves recomputing it, and its wait for the device).
    """
    if n is None:
        n = exponent_up(x)  # defined for every entry (negative ones included), so both checks are one sync
    return encode_checked(x, base, n)


def decode(code: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """float32 values of ``code`` (uint8) against ``base`` (int32, broadcast): ``0 → 0``, ``INF_CODE → +inf``,
    else ``dec(base + code − 1) ≥`` the value encoded."""
    c = code.to(torch.int32)
    finite = (c > 0) & (c < INF_CODE)
    n = torch.where(finite, base.to(torch.int32) + c - 1, 0)
    val = dec(n.clamp(MIN_N, MAX_N))
    return torch.where(finite, val, torch.where(c == 0, 0.0, math.inf)).to(torch.float32)


def rebase(code: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Codes for a base raised by ``shift ≥ 0`` codes: ``c → max(c − shift, 1)`` for finite positive codes,
    ``0`` and ``INF_CODE`` unchanged. Each re-coded value is ``≥`` the value it replaces (``dec`` increases),
    so every bound read from the buffer stays valid."""
    c = code.to(torch.int64)
    moved = (c - shift.to(torch.int64)).clamp(min=1)
    return torch.where((c > 0) & (c < INF_CODE), moved, c).to(torch.uint8)
