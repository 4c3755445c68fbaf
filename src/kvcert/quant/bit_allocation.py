"""Certificate-driven bit allocation: each (layer, KV head) gets the narrowest dithered key width, and each layer
the cheapest value codec, that its calibration certificates allow (``docs/codecs.md#bit-allocation``).

The inputs are measured by a calibration pass (:mod:`kvcert.eval.bit_calibration`): for every candidate key width
``b`` the *coverage* ``C_b[l, h]``, the share of reads of KV head ``h`` of layer ``l`` whose certified meter is
``≤ τ`` in every one of its query heads (the reads a ``Gate.certified(τ)`` serves without paging in), and for
every candidate value codec ``v`` the share ``V_v[l]`` of the layer's cells whose certified value term
``Σ_t p̃_t‖Δv_t‖`` is ``≤ value_tol`` (the reads a gate with ``value_tol`` serves without promoting values).

Rule (:func:`choose_key_bits`, :func:`choose_values`): head ``(l, h)`` takes the fewest bits ``b`` with
``C_b[l, h] ≥ C_ref[l, h] − max_loss`` (``ref`` the widest candidate), and layer ``l`` the value codec of fewest
bytes with ``V_v[l] ≥ V_ref[l] − max_loss``: every head and layer keeps its reference coverage up to ``max_loss``,
at the fewest bytes. The allocation is a policy, not a certificate: a read of the allocated cache is gated on its
own certificates, whatever the calibration said.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcert.quant.base import bytes_per_token_head
from kvcert.quant.dither import DITHER_BITS, DitherCodec
from kvcert.quant.registry import BUILTINS, get

#: the value codecs a calibration considers by default (per-token codecs, widest first)
VALUE_CANDIDATES: tuple[str, ...] = ("int8", "int4", "int2")


def _check_coverage(coverage: Mapping[Any, torch.Tensor], what: str) -> tuple[int, ...]:
    if not coverage:
        raise ValueError(f"{what}: no candidate measured")
    shapes = {tuple(c.shape) for c in coverage.values()}
    if len(shapes) != 1:
        raise ValueError(f"{what}: every candidate must cover the same cells, got shapes {sorted(shapes)}")
    for name, c in coverage.items():
        if not bool(((c >= 0) & (c <= 1)).all()):
            raise ValueError(f"{what}[{name!r}] must be shares in [0, 1] (no NaN)")
    return shapes.pop()


def _check_loss(max_loss: float) -> None:
    if not 0.0 <= max_loss <= 1.0:
        raise ValueError(f"max_loss must be in [0, 1], got {max_loss}")


def choose_key_bits(coverage: Mapping[int, torch.Tensor], max_loss: float) -> tuple[tuple[int, ...], ...]:
    """Per (layer, KV head) the fewest bits ``b`` among ``coverage``'s keys (dithered widths) with
    ``coverage[b][l, h] ≥ coverage[b_max][l, h] − max_loss``; ``coverage[b]`` is ``[L, Hkv]``. The widest width
    always qualifies, so every head gets one."""
    _check_loss(max_loss)
    shape = _check_coverage(coverage, "coverage")
    if len(shape) != 2:
        raise ValueError(f"coverage must be [layers, KV heads] per width, got shape {shape}")
    widths = sorted(coverage)
    if any(b not in DITHER_BITS for b in widths):
        raise ValueError(f"coverage keys must be dithered widths {DITHER_BITS}, got {widths}")
    floor = coverage[widths[-1]] - max_loss
    chosen = torch.full(shape, widths[-1], dtype=torch.int64)
    for b in reversed(widths[:-1]):  # narrower and narrower: the last width that qualifies wins
        chosen = torch.where(coverage[b] >= floor, torch.full_like(chosen, b), chosen)
    return tuple(tuple(int(b) for b in row) for row in chosen)


def choose_values(share: Mapping[str, torch.Tensor], max_loss: float, head_dim: int = 64) -> tuple[str, ...]:
    """Per layer the value codec of fewest measured bytes (:func:`~kvcert.quant.bytes_per_token_head` at
    ``head_dim``) among ``share``'s keys with ``share[v][l] ≥ share[ref][l] − max_loss``, ``ref`` the codec of most
    bytes; ``share[v]`` is ``[L]``."""
    _check_loss(max_loss)
    shape = _check_coverage(share, "share")
    if len(shape) != 1:
        raise ValueError(f"share must be [layers] per value codec, got shape {shape}")
    unknown = sorted(set(share) - set(BUILTINS))
    if unknown:
        raise ValueError(f"share names unknown value codecs {unknown}")
    cost = {v: bytes_per_token_head(get(v), D=head_dim) for v in share}
    by_cost = sorted(share, key=lambda v: (cost[v], v))
    floor = share[by_cost[-1]] - max_loss
    return tuple(next(v for v in by_cost if float(share[v][layer]) >= float(floor[layer])) for layer in range(shape[0]))


@dataclass(frozen=True)
class Allocation:
    """Per-layer codecs from a calibration: ``key_bits[l][h]`` (dithered width of KV head ``h`` of layer ``l``)
    and ``values[l]`` (value codec name), with what they were chosen by (``tau``, ``max_loss``, ``value_tol``;
    ``None``: one value codec given for every layer) and the calibration's provenance (model, corpus, tokens; never
    the evaluation samples)."""

    key_bits: tuple[tuple[int, ...], ...]
    values: tuple[str, ...]
    tau: float
    max_loss: float
    value_tol: float | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.key_bits or len(self.key_bits) != len(self.values):
            raise ValueError(
                f"key_bits and values must list the same layers, got {len(self.key_bits)} and {len(self.values)}"
            )
        for layer, row in enumerate(self.key_bits):
            if not row or any(isinstance(b, bool) or b not in DITHER_BITS for b in row):
                raise ValueError(f"key_bits[{layer}] must be dithered widths in {DITHER_BITS}, got {row}")
        unknown = sorted(set(self.values) - set(BUILTINS))
        if unknown:
            raise ValueError(f"values names unknown codecs {unknown}")

    def key_codecs(self, group_size: int = 32) -> tuple[DitherCodec, ...]:
        """One ``dither-mixed`` key codec per layer."""
        return tuple(DitherCodec(group_size=group_size, head_bits=row) for row in self.key_bits)

    def mean_key_bits(self) -> float:
        """Code bits per key element, averaged over every (layer, KV head)."""
        flat = [b for row in self.key_bits for b in row]
        return sum(flat) / len(flat)

    def bytes_per_token(self, head_dim: int = 64) -> float:
        """Key + value codec bytes per token over all layers and KV heads (measured from encoded tensors;
        witnesses excluded)."""
        keys = sum(
            bytes_per_token_head(c, D=head_dim) * len(row)
            for c, row in zip(self.key_codecs(), self.key_bits, strict=True)
        )
        values = sum(
            bytes_per_token_head(get(v), D=head_dim) * len(row)
            for v, row in zip(self.values, self.key_bits, strict=True)
        )
        return keys + values

    def save(self, path: str | Path) -> None:
        """Write the allocation as JSON."""
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Allocation:
        """Read an allocation written by :meth:`save`; ``ValueError`` naming the file for a malformed one."""
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
            return cls(
                key_bits=tuple(tuple(int(b) for b in row) for row in doc["key_bits"]),
                values=tuple(str(v) for v in doc["values"]),
                tau=float(doc["tau"]),
                max_loss=float(doc["max_loss"]),
                value_tol=None if doc.get("value_tol") is None else float(doc["value_tol"]),
                provenance=dict(doc.get("provenance", {})),
            )
        except (KeyError, TypeError, ValueError) as err:  # JSONDecodeError is a ValueError
            raise ValueError(f"{path}: not a kvcert allocation ({err})") from None
