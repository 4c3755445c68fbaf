"""The query-subspace witness ``qsw-int{8,4}`` (``docs/math.md#query-subspace-witness``): a stored key-residual witness
whose radius is exact inside a calibrated query subspace.

Per (layer, KV head) a basis ``U ∈ ℝ^{D×k}`` — the top-``k`` eigenvectors of the second moment of the head's
post-RoPE queries on a calibration text (:func:`calibrate_basis`) — is fixed once. Per token and KV head the
witness stores, for the residual ``Δ = k̂ − k`` of a key codec:

* ``ŵ``: ``w = UᵀΔ`` (float64) through symmetric RTN at ``bits`` bits with one fp16 scale per token
  (:class:`~kvcert.quant.rtn.RTNCodec`, ``group_size = k``);
* ``η ≥ ‖ŵ − w‖`` and ``ρ ≥ ‖Δ − Uw‖``, measured in float64 and rounded *up* to fp16 (``+inf`` beyond its
  range: fail closed, the read cannot certify that token).

:meth:`QuerySubspaceWitness.radius` is :func:`kvcert.bounds.query_subspace_radius` over them, sound
for every query whatever ``U`` (orthonormality only makes it tight). Bytes (measured from the stored tensors):
``k·bits/8`` code bytes + 2 (scale) + 2 (``η``) + 2 (``ρ``) per token and KV head, plus the basis, ``H·D·k``
float32 per layer, once. The witness is measured beside the store's band witness
(``benchmarks/witness_tightness.py``); the cache does not serve it (``docs/results.md`` says why).
"""

from __future__ import annotations

import torch

from kvcert.bounds.rope import round_up_f32
from kvcert.bounds.subspace_radius import query_subspace_radius
from kvcert.checks import fail_if
from kvcert.quant.base import Packed, check_input
from kvcert.quant.rtn import RTNCodec
from kvcert.quant.scales import FP16_MAX, fp16_up

F64 = torch.float64
BITS = (8, 4)


def calibrate_basis(queries: torch.Tensor, rank: int) -> torch.Tensor:
    """Per head, the top-``rank`` eigenvectors of ``QᵀQ`` (float64), as float32 ``[H, D, rank]`` with orthonormal
    columns up to rounding: ``queries[H, N, D]`` are the post-RoPE queries of each KV head's query group on a
    calibration text. Raises ``ValueError`` for a bad shape, non-finite queries or ``rank`` outside ``[1, D]``."""
    if queries.dim() != 3:
        raise ValueError(f"queries must be [H, N, D], got shape {tuple(queries.shape)}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= queries.shape[-1]:
        raise ValueError(f"rank must be an int in [1, D={queries.shape[-1]}], got {rank!r}")
    fail_if(~torch.isfinite(queries).all(), lambda: ValueError("queries contain non-finite entries"))
    q = queries.to(F64)
    _, vectors = torch.linalg.eigh(q.transpose(-1, -2) @ q)  # ascending eigenvalues
    return vectors.flip(-1)[..., :rank].to(torch.float32).contiguous()


def _fp16_up(x: torch.Tensor) -> torch.Tensor:
    """A non-negative float64 tensor as fp16 rounded *up*: :func:`~kvcert.quant.scales.fp16_up`, with ``+inf``
    beyond the fp16 range instead of an error (a witness fails closed; a scale refuses the write)."""
    y = round_up_f32(x)
    return torch.where(y > FP16_MAX, torch.inf, fp16_up(y.clamp(max=FP16_MAX), "witness")).to(torch.float16)


class QuerySubspaceWitness:
    """``qsw-int{bits}`` over a per-KV-head basis ``basis[H, D, k]`` (module docstring)."""

    def __init__(self, basis: torch.Tensor, bits: int = 8) -> None:
        if not isinstance(basis, torch.Tensor) or basis.dim() != 3 or not basis.is_floating_point():
            raise ValueError(f"basis must be a floating [H, D, k] tensor, got {getattr(basis, 'shape', basis)!r}")
        if basis.shape[-1] > basis.shape[-2] or basis.shape[-1] < 1:
            raise ValueError(f"basis rank k={basis.shape[-1]} must be in [1, D={basis.shape[-2]}]")
        fail_if(~torch.isfinite(basis).all(), lambda: ValueError("basis contains non-finite entries"))
        if bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
        if bits == 4 and basis.shape[-1] % 2:
            raise ValueError(f"4-bit codes pack two per byte: the basis rank must be even, got k={basis.shape[-1]}")
        self.basis = basis.to(torch.float32).contiguous()
        self.bits = bits
        self.name = f"qsw-int{bits}"
        self._codes = RTNCodec(bits, group_size=basis.shape[-1])

    @property
    def basis_bytes(self) -> int:
        """Bytes of the basis (stored once per layer, not per token)."""
        return self.basis.numel() * self.basis.element_size()

    def _check_shape(self, shape: tuple[int, ...], what: str) -> None:
        h, d, _ = self.basis.shape
        if len(shape) != 4 or shape[1] != h or shape[-1] != d:
            raise ValueError(f"{what} must be [B, H={h}, T, D={d}] for this basis, got {shape}")

    def encode(self, x: torch.Tensor, x_hat: torch.Tensor) -> Packed:
        """The witness of the residual ``x̂ − x`` of keys ``x[B, H, T, D]`` served as ``x_hat`` (same shape).
        Raises ``ValueError`` on a shape that does not fit the basis or non-finite keys."""
        for name, t in (("x", x), ("x_hat", x_hat)):
            check_input(t)
            self._check_shape(tuple(t.shape), name)
        if x.shape != x_hat.shape:
            raise ValueError(f"x {tuple(x.shape)} and x_hat {tuple(x_hat.shape)} must have the same shape")
        u = self.basis.to(F64).unsqueeze(0)  # [1, H, D, k]
        delta = x_hat.to(F64) - x.to(F64)
        w = delta @ u  # [B, H, T, k]
        packed, w_hat32 = self._codes.encode_decode(w)
        w_hat = w_hat32.to(F64)
        eta = _fp16_up(torch.linalg.vector_norm(w_hat - w, dim=-1))
        rho = _fp16_up(torch.linalg.vector_norm(delta - w @ u.transpose(-1, -2), dim=-1))
        return Packed(self.name, tuple(x.shape), {**packed.tensors, "eta": eta, "rho": rho})

    def decode(self, packed: Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ŵ [B, H, T, k], η [B, H, T], ρ [B, H, T])`` in float64 from the stored tensors."""
        if packed.codec != self.name:
            raise ValueError(f"packed was written by {packed.codec!r}, not {self.name!r}")
        self._check_shape(packed.shape, "packed")
        codes = Packed(self._codes.name, (*packed.shape[:-1], self.basis.shape[-1]), packed.tensors)
        t = packed.tensors
        return self._codes.decode(codes).to(F64), t["eta"].to(F64), t["rho"].to(F64)

    def radius(self, packed: Packed, q: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Radii ``c[B, H, Q, T] ≥ |scale·q·Δ_t|`` for queries ``q[B, H, Q, D]`` (one KV head's query, per head).
        Raises ``ValueError`` unless ``q`` has the packed tensor's ``B``, ``H`` and ``D``."""
        b, h, _, d = packed.shape
        if q.dim() != 4 or (q.shape[0], q.shape[1], q.shape[-1]) != (b, h, d):
            raise ValueError(f"q must be [B={b}, H={h}, Q, D={d}] for this witness, got {tuple(q.shape)}")
        w_hat, eta, rho = self.decode(packed)
        return query_subspace_radius(q, self.basis.unsqueeze(0), w_hat, eta, rho, scale)
