"""The stored form of a compressed KV tensor, the codec interface, and ``quantize`` (encode + witnesses).

Contract (``docs/codecs.md#codec-contract``): a codec is a shape- and token-preserving map ``x → x̂`` whose stored
form (:class:`Packed`) holds only the tensors that would live in device memory; ``decode`` is a pure
function of the stored form (and, for dithered codecs, of the regenerated dither key). The Tier-A
witness of the residual ``x̂ − x`` is computed once at write time by :func:`quantize`.
"""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvcert.bounds.rope import Pairing, band_norms
from kvcert.checks import fail_if

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Packed:
    """Stored form of one encoded tensor: only real tensors that would live in device memory. ``heads`` names the
    tensors whose head axis (dim 1) holds only some heads of ``shape[1]``, in that order (a per-head mixed codec,
    e.g. ``dither-mixed``); every other tensor holds all heads."""

    codec: str
    shape: tuple[int, ...]
    tensors: dict[str, torch.Tensor]
    heads: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """``Σ numel·element_size`` over the stored tensors (measured, not a formula)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class DitherKey:
    """Key of the counter-based dither generator; the dither is regenerated from it, never stored.

    ``request``: int64 ``[B]`` request UID per batch row; ``positions``: int64 ``[B, T]`` logical token
    positions. The head index is dim −3 of ``x`` and the channel is dim −1.
    """

    seed: int
    request: torch.Tensor
    layer: int
    positions: torch.Tensor

    def check(self, shape: tuple[int, ...]) -> None:
        """Raise ``ValueError`` unless this key fits a tensor of ``shape = (B, H, T, D)``."""
        for field in ("seed", "layer"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
                raise ValueError(f"key.{field} must be an int in the int64 range, got {value!r}")
        b, _, t, _ = shape
        if self.request.dtype != torch.int64 or tuple(self.request.shape) != (b,):
            got = f"{self.request.dtype} {tuple(self.request.shape)}"
            raise ValueError(f"key.request must be int64 [B]={b}, got {got}")
        if self.positions.dtype != torch.int64 or tuple(self.positions.shape) != (b, t):
            raise ValueError(
                f"key.positions must be int64 [B, T]={(b, t)}, got {self.positions.dtype} {tuple(self.positions.shape)}"
            )


def check_input(x: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``x`` is a finite floating ``[B, H, T, D]`` tensor (fail closed)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x must be [B, H, T, D], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be floating point, got dtype {x.dtype}")
    fail_if(
        ~torch.isfinite(x).all(),
        lambda: ValueError(
            f"x contains non-finite entries ({int(torch.isnan(x).sum())} NaN, {int(torch.isinf(x).sum())} inf); "
            "keep such entries exact"
        ),
    )


class Codec(ABC):
    """A KV codec: ``encode`` to a :class:`Packed` of real stored tensors, ``decode`` back to float32.

    ``encode`` validates its input (finite ``[B, H, T, D]``, ``T % block == 0``, key present iff
    ``needs_key``) and delegates to ``_encode``; ``decode`` checks the packed codec name and delegates to
    ``_decode``.
    """

    name: str
    bits: float
    block: int = 1
    residual_window: int = 0
    tier_b: bool = False
    needs_key: bool = False
    group_size: int = 32
    channel_mask: torch.Tensor | None = None
    heads: int | None = None  # the head count a per-head codec was built for (None: any)

    def encode(self, x: torch.Tensor, key: DitherKey | None = None) -> Packed:
        """Encode ``x[B, H, T, D]``; raise ``ValueError`` on non-finite input or a bad shape/key."""
        self._check_encode(x, key)
        return self._encode(x, key)

    def encode_decode(self, x: torch.Tensor, key: DitherKey | None = None) -> tuple[Packed, torch.Tensor]:
        """``(encode(x, key), decode of it)``: the stored form of ``x[B, H, T, D]`` and what it decodes to, with
        :meth:`encode`'s checks (a write block's round trip; a codec may share work between the two halves,
        with the same values)."""
        self._check_encode(x, key)
        return self._encode_decode(x, key)

    def _check_encode(self, x: torch.Tensor, key: DitherKey | None) -> None:
        check_input(x)
        if x.shape[-2] % self.block:
            raise ValueError(f"x has T={x.shape[-2]} tokens; {self.name!r} encodes blocks of {self.block}")
        self._check_heads(tuple(x.shape))
        self._check_key(key, tuple(x.shape))

    def _check_heads(self, shape: tuple[int, ...]) -> None:
        if self.heads is not None and shape[1] != self.heads:
            raise ValueError(f"codec {self.name!r} is built for {self.heads} heads, got a tensor of {shape[1]} heads")

    def _encode_decode(self, x: torch.Tensor, key: DitherKey | None) -> tuple[Packed, torch.Tensor]:
        packed = self._encode(x, key)
        return packed, self._decode(packed, key)

    def decode(self, packed: Packed, key: DitherKey | None = None) -> torch.Tensor:
        """Reconstruct ``x̂`` as float32 ``[B, H, T, D]`` from the stored tensors (and the key if needed)."""
        if packed.codec != self.name:
            raise ValueError(f"packed was written by codec {packed.codec!r}, not {self.name!r}")
        self._check_heads(packed.shape)
        self._check_key(key, packed.shape)
        return self._decode(packed, key)

    def steps(self, packed: Packed) -> torch.Tensor | None:
        """Tier-B per-token per-group steps ``s_{t,g}`` (float32 ``[B, H, T, D/group_size]``); None here."""
        return None

    def _check_key(self, key: DitherKey | None, shape: tuple[int, ...]) -> None:
        if self.needs_key:
            if key is None:
                raise ValueError(f"codec {self.name!r} needs a DitherKey (key=None given)")
            key.check(shape)

    @abstractmethod
    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed: ...

    @abstractmethod
    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor: ...


@dataclass
class Quantized:
    """Result of :func:`quantize`: stored form, reconstruction and write-time witnesses of ``x̂ − x``."""

    packed: Packed
    x_hat: torch.Tensor
    band_norms: torch.Tensor
    residual_norms: torch.Tensor
    steps: torch.Tensor | None


def quantize(
    codec: Codec,
    x: torch.Tensor,
    *,
    bands: int = 8,
    pairing: Pairing = "rotate_half",
    key: DitherKey | None = None,
) -> Quantized:
    """Encode and decode ``x`` and compute the Tier-A witnesses of the residual ``Δ = x̂ − x`` (float64).

    ``band_norms[B, H, T, bands]`` is :func:`kvcert.bounds.rope.band_norms` of ``Δ`` under ``pairing`` and
    ``residual_norms[B, H, T] = ‖Δ‖₂``; ``steps`` are the Tier-B steps (dither only, else None).
    """
    packed = codec.encode(x, key)
    x_hat = codec.decode(packed, key)
    delta = x_hat.to(torch.float64) - x.to(torch.float64)
    return Quantized(
        packed=packed,
        x_hat=x_hat,
        band_norms=band_norms(delta, bands, pairing),
        residual_norms=torch.linalg.vector_norm(delta, dim=-1),
        steps=codec.steps(packed),
    )


def sample_key(x: torch.Tensor, seed: int = 0, layer: int = 0) -> DitherKey:
    """A :class:`DitherKey` with request UIDs ``0..B−1`` and positions ``0..T−1`` for ``x[B, H, T, D]``."""
    b, _, t, _ = x.shape
    return DitherKey(
        seed=seed,
        request=torch.arange(b, dtype=torch.int64),
        layer=layer,
        positions=torch.arange(t, dtype=torch.int64).expand(b, t).contiguous(),
    )


def bytes_per_token_head(codec: Codec, D: int = 64, tokens: int = 64) -> float:
    """Stored bytes per (token, head), measured from the tensors of an encoded random ``[1, 1, T, D]`` sample.

    ``T`` is ``tokens`` rounded up to a multiple of ``codec.block``; a per-head codec encodes its ``heads`` heads and
    the bytes are averaged over them. A copy of ``codec`` is encoded, so calibration state (outlier-bypass pairs)
    of the given codec is left untouched.
    """
    if D < 2 or tokens < 1:
        raise ValueError(f"D must be >= 2 and tokens >= 1, got D={D}, tokens={tokens}")
    t = -(-tokens // codec.block) * codec.block
    h = codec.heads or 1
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, h, t, D, generator=gen)
    key = sample_key(x) if codec.needs_key else None
    return copy.deepcopy(codec).encode(x, key).nbytes / (t * h)
