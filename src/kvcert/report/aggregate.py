"""Reduce per-sample :class:`~kvcert.cache.telemetry.Telemetry` to report numbers and maps.

Pooling over samples is by cells: a fraction pooled over samples is the cell-weighted mean of the
per-sample fractions (each sample's fraction times its recorded cells, over all recorded cells), which
equals the fraction computed on all cells at once for q-head quantities.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvcert.cache.telemetry import Telemetry


def fp16_bytes_per_token(tel: Telemetry) -> float:
    """Bytes of one token's K and V across all layers at fp16: ``2 (K,V) · 2 B · layers · Hkv · head_dim``."""
    _, layers, _, hq = tel.certificates.shape
    return float(2 * 2 * layers * (hq // tel.group_size) * tel.head_dim)


def stored_fraction(tels: Sequence[Telemetry]) -> float:
    """Stored bytes over the fp16 bytes of the same entries, pooled over samples."""
    fp16 = sum(t.bytes_fp16 for t in tels)
    return sum(t.bytes_stored for t in tels) / fp16 if fp16 else float("nan")


def byte_numbers(tels: Sequence[Telemetry]) -> dict[str, float]:
    """Measured byte figures of a variant pooled over its samples, capacity and bandwidth kept apart.

    ``bytes_device`` / ``bytes_fp16`` / ``page_in_bytes`` / ``transient_page_ins`` / ``upgraded_entries`` /
    ``heavy_entries`` are sums over samples; ``capacity = Σ bytes_fp16 / Σ bytes_device``;
    ``page_in_ratio = Σ bytes_paged / Σ bytes_fp16`` (page-in traffic relative to the requests' fp16 K/V);
    ``bytes_per_token_*`` scale the fp16 bytes of one token (:func:`fp16_bytes_per_token`) by the device resp. stored
    (codes + exact entries) fraction.
    """
    fp16 = sum(t.bytes_fp16 for t in tels)
    device = sum(t.bytes_device for t in tels)
    paged = sum(t.bytes_paged for t in tels)
    per_token = fp16_bytes_per_token(tels[0])
    nan = float("nan")
    return {
        "bytes_per_token_device": per_token * device / fp16 if fp16 else nan,
        "bytes_per_token_stored": per_token * stored_fraction(tels),
        "bytes_per_token_fp16": per_token,
        "capacity": fp16 / device if device else nan,
        "bytes_device": device,
        "bytes_fp16": fp16,
        "bytes_host": sum(t.bytes_host for t in tels),
        "page_in_bytes": paged,
        "page_in_ratio": paged / fp16 if fp16 else nan,
        "transient_page_ins": sum(t.transient_page_ins for t in tels),
        "upgraded_entries": sum(t.upgraded_entries for t in tels),
        "heavy_entries": sum(t.heavy_entries for t in tels),
    }


def pooled(tels: Sequence[Telemetry], fn: Callable[[Telemetry], float]) -> float:
    """Cell-weighted mean of ``fn(t)`` over samples (samples with no recorded cell or NaN are skipped)."""
    num = den = 0.0
    for t in tels:
        v = fn(t)
        if t.cells and v == v:
            num += v * t.cells
            den += t.cells
    return num / den if den else float("nan")


def cells(tels: Sequence[Telemetry], attr: str) -> torch.Tensor:
    """All recorded cells of tensor ``attr`` (e.g. ``certificates``, ``tier_b``, ``true_tv``), flattened."""
    out = []
    for t in tels:
        vals = getattr(t, attr)
        if vals is not None:
            out.append(vals[t.recorded].double())
    return torch.cat(out) if out else torch.empty(0, dtype=torch.float64)


def quantile(tels: Sequence[Telemetry], attr: str, q: float) -> float:
    """The ``q``-quantile (``torch.quantile``, linear) of :func:`cells` ``attr`` pooled over the samples' recorded cells
    (NaN with none)."""
    vals = cells(tels, attr)
    return float(torch.quantile(vals, q)) if vals.numel() else float("nan")


def layer_head(tels: Sequence[Telemetry], fn: Callable[[Telemetry], torch.Tensor]) -> torch.Tensor:
    """``[layers, Hq]`` mean over samples, steps and rows of the cell map ``fn(t)`` (recorded cells only)."""
    total = count = None
    for t in tels:
        vals = fn(t).double()
        rec = t.recorded
        s = torch.where(rec, vals, torch.zeros_like(vals)).sum(dim=(0, 2))
        c = rec.sum(dim=(0, 2)).double()
        total = s if total is None else total + s
        count = c if count is None else count + c
    if total is None or count is None:
        raise ValueError("tels must not be empty")
    return total / count  # NaN where a (layer, head) was never recorded


def certificate_map(tels: Sequence[Telemetry]) -> torch.Tensor:
    """Mean certified TV bound per (layer, query head)."""
    return layer_head(tels, lambda t: t.certificates)


def saturation_map(tels: Sequence[Telemetry]) -> torch.Tensor:
    """Fraction of cells per (layer, query head) whose unclipped meter is ``>= 1`` (bound vacuous)."""
    return layer_head(tels, lambda t: (t.raw >= 1).double())
