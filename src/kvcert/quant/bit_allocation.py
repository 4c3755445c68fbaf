"""Certificate-driven bit allocation: each (layer, KV head) gets the narrowest dithered key width and the cheapest
value codec that its calibration certificates allow (``docs/codecs.md#bit-allocation``).

The inputs are measured by a calibration pass (:mod:`kvcert.eval.bit_calibration`): for every candidate key width
``b`` the *coverage* ``C_b[l, h]``, the share of reads of KV head ``h`` of layer ``l`` whose certified meter is
``≤ τ`` in every one of its query heads (the reads a ``Gate.certified(τ)`` serves without paging in), and for
every candidate value codec ``v`` the share ``V_v[l, h]`` of the reads of KV head ``h`` of layer ``l`` whose
certified value term ``Σ_t p̃_t‖Δv_t‖`` is ``≤ value_tol`` in every one of its query heads (the reads a gate with
``value_tol`` serves without promoting values).

Rule (:func:`choose_key_bits`, :func:`choose_values`): head ``(l, h)`` takes the fewest bits ``b`` with
``C_b[l, h] ≥ C_ref[l, h] − max_loss`` (``ref`` the widest candidate), and the value codec of fewest bytes with
``V_v[l, h] ≥ V_ref[l, h] − max_loss``: every head keeps its reference coverage up to ``max_loss``, at the fewest
bytes. A layer whose KV heads take different value codecs stores them with one
:class:`~kvcert.quant.per_head.PerHeadCodec`.

The allocation is a policy, not a certificate: a read of the allocated cache is gated on its
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
from kvcert.quant.per_head import PerHeadCodec
from kvcert.quant.registry import BUILTINS, resolve

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


def choose_values(
    share: Mapping[str, torch.Tensor], max_loss: float, head_dim: int = 64
) -> tuple[tuple[str, ...], ...]:
    """Per (layer, KV head) the value codec of fewest measured bytes (:func:`~kvcert.quant.bytes_per_token_head` at
    ``head_dim``) among ``share``'s keys with ``share[v][l, h] ≥ share[ref][l, h] − max_loss``, ``ref`` the codec of
    most bytes; ``share[v]`` is ``[L, Hkv]``. The costliest codec always qualifies, so every head gets one."""
    _check_loss(max_loss)
    shape = _check_coverage(share, "share")
    if len(shape) != 2:
        raise ValueError(f"share must be [layers, KV heads] per value codec, got shape {shape}")
    unknown = sorted(set(share) - set(BUILTINS))
    if unknown:
        raise ValueError(f"share names unknown value codecs {unknown}")
    cost = {v: bytes_per_token_head(resolve(v, "value"), D=head_dim) for v in share}
    by_cost = sorted(share, key=lambda v: (cost[v], v))
    floor = share[by_cost[-1]] - max_loss
    return tuple(
        tuple(next(v for v in by_cost if float(share[v][layer, h]) >= float(floor[layer, h])) for h in range(shape[1]))
        for layer in range(shape[0])
    )


def _value_rows(
    values: tuple[str | tuple[str, ...], ...], key_bits: tuple[tuple[int, ...], ...]
) -> tuple[tuple[str, ...], ...]:
    """``values`` with a name in place of a row spread over the KV heads of its layer (``key_bits``' row);
    ``ValueError`` unless both list the same layers, at least one."""
    if not key_bits or len(values) != len(key_bits):
        raise ValueError(f"key_bits and values must list the same layers, got {len(key_bits)} and {len(values)}")
    return tuple((v,) * len(bits) if isinstance(v, str) else tuple(v) for v, bits in zip(values, key_bits, strict=True))


@dataclass(frozen=True)
class Allocation:
    """Per-(layer, KV head) codecs from a calibration: ``key_bits[l][h]`` (dithered width of KV head ``h`` of layer
    ``l``) and ``values[l][h]`` (its value codec name; a name in place of a row means that codec on every KV head of
    the layer), with what they were chosen by (``tau``, ``max_loss``, ``value_tol``; ``None``: one value codec given
    for every head) and the calibration's provenance (model, corpus, tokens; never the evaluation samples)."""

    key_bits: tuple[tuple[int, ...], ...]
    values: tuple[tuple[str, ...], ...]
    tau: float
    max_loss: float
    value_tol: float | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rows = _value_rows(self.values, self.key_bits)
        for layer, row in enumerate(self.key_bits):
            if not row or any(isinstance(b, bool) or b not in DITHER_BITS for b in row):
                raise ValueError(f"key_bits[{layer}] must be dithered widths in {DITHER_BITS}, got {row}")
        for layer, (names, bits) in enumerate(zip(rows, self.key_bits, strict=True)):
            if len(names) != len(bits) or not all(isinstance(v, str) for v in names):
                raise ValueError(f"values[{layer}] must name one value codec per KV head ({len(bits)}), got {names}")
        unknown = sorted({v for names in rows for v in names} - set(BUILTINS))
        if unknown:
            raise ValueError(f"values names unknown codecs {unknown}")
        object.__setattr__(self, "values", rows)

    def key_codecs(self, group_size: int = 32) -> tuple[DitherCodec, ...]:
        """One ``dither-mixed`` key codec per layer."""
        return tuple(DitherCodec(group_size=group_size, head_bits=row) for row in self.key_bits)

    def value_codecs(self) -> tuple[str | PerHeadCodec, ...]:
        """One value codec per layer: its name when every KV head of the layer takes the same, else a
        :class:`~kvcert.quant.per_head.PerHeadCodec` of the heads' codecs."""
        return tuple(row[0] if len(set(row)) == 1 else PerHeadCodec(row) for row in self.values)

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
        per_head = {v: bytes_per_token_head(resolve(v, "value"), D=head_dim) for row in self.values for v in set(row)}
        values = sum(per_head[v] for row in self.values for v in row)
        return keys + values

    def save(self, path: str | Path) -> None:
        """Write the allocation as JSON."""
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Allocation:
        """Read an allocation written by :meth:`save`; ``ValueError`` naming the file for a malformed one."""
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
            key_bits = tuple(tuple(int(b) for b in row) for row in doc["key_bits"])
            return cls(
                key_bits=key_bits,
                values=_value_rows(tuple(doc["values"]), key_bits),
                tau=float(doc["tau"]),
                max_loss=float(doc["max_loss"]),
                value_tol=None if doc.get("value_tol") is None else float(doc["value_tol"]),
                provenance=dict(doc.get("provenance", {})),
            )
        except (KeyError, TypeError, ValueError) as err:  # JSONDecodeError is a ValueError
            raise ValueError(f"{path}: not a kvcert allocation ({err})") from None
