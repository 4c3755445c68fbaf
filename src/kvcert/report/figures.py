"""Report figures (matplotlib, Agg backend); each function writes one PNG and returns its path.

Inputs are plain tensors/lists already reduced by the caller; NaN cells (not recorded) are shown blank.
Titles carry the tier of what is drawn (certified bound, partial, measured).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvcert.report.results import write_atomic  # noqa: E402

TAUS = np.linspace(0.0, 1.0, 101)


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90, bbox_inches="tight", metadata={"Software": None})  # long labels too
    plt.close(fig)
    return write_atomic(path, png.getvalue())  # never through a link at ``path``


def layer_head_map(values: torch.Tensor, path: Path, title: str, label: str, vmax: float = 1.0) -> Path:
    """Heatmap of a ``[layers, heads]`` matrix (rows = layers), colour range ``[0, vmax]``."""
    if values.ndim != 2:
        raise ValueError(f"values must be [layers, heads], got shape {tuple(values.shape)}")
    fig, ax = plt.subplots(figsize=(5, 6))
    im = ax.imshow(values.double().numpy(), aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest")
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label=label)
    return _save(fig, path)


def coverage_curve(cells: Mapping[str, torch.Tensor], path: Path, title: str) -> Path:
    """For each series, the fraction of its (finite) cells with value ``<= τ`` for τ in [0, 1]."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, vals in cells.items():
        v = vals[torch.isfinite(vals)].double().numpy()
        if v.size:
            ax.plot(TAUS, [(v <= t).mean() for t in TAUS], label=name)
    ax.set_xlabel("τ (TV bound)")
    ax.set_ylabel("coverage: fraction of cells with bound ≤ τ")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


@dataclass(frozen=True)
class AccuracyPoint:
    """Accuracy of one scheme variant with its paired CI on the difference to the dense baseline."""

    label: str
    accuracy: float
    diff_low: float
    diff_high: float
    bytes_per_token: float | None  # None: no read, no effective bytes (left out of bytes_vs_accuracy)
    gated: bool | None  # None: a peer cache that is not kvcert's (no gate, no certificate)
    resident: bool = False  # a resident variant: bytes_per_token over its whole context (resident + omitted)


def accuracy_bars(points: Sequence[AccuracyPoint], baseline: float, path: Path) -> Path:
    """Bars of accuracy per variant; error bars = baseline + paired 95% CI of (variant − baseline)."""
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(points) + 2), 4))
    x = np.arange(len(points))
    acc = np.array([p.accuracy for p in points])
    lo = np.array([baseline + p.diff_low for p in points])
    hi = np.array([baseline + p.diff_high for p in points])
    colors = ["tab:green" if p.gated else "tab:red" for p in points]
    ax.bar(x, acc, color=colors)
    ax.errorbar(
        x,
        acc,
        yerr=[np.clip(acc - lo, 0, None), np.clip(hi - acc, 0, None)],
        fmt="none",
        ecolor="k",
        capsize=3,
    )
    ax.axhline(baseline, color="k", linestyle="--", linewidth=1, label="dense")
    ax.set_xticks(x, [p.label for p in points], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("accuracy (empirical)")
    ax.set_ylim(0, 1.05)
    ax.set_title("accuracy per scheme: raw (red) vs gated (green), bars = paired 95% CI", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def accuracy_vs_budget(
    series: Mapping[str, Sequence[tuple[float, float, float, float]]], baseline: float, path: Path, title: str
) -> Path:
    """Accuracy against the kept fraction, one line per policy: ``series[name] = [(kept, acc, lo, hi)]`` with
    ``lo``/``hi`` the paired 95% CI of (policy − reference), drawn around the reference accuracy."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in series.items():
        pts = sorted(pts)
        kept = np.array([p[0] for p in pts])
        acc = np.array([p[1] for p in pts])
        lo = np.array([baseline + p[2] for p in pts])
        hi = np.array([baseline + p[3] for p in pts])
        ax.errorbar(
            kept, acc, yerr=[np.clip(acc - lo, 0, None), np.clip(hi - acc, 0, None)], marker="o", capsize=3, label=name
        )
    ax.axhline(baseline, color="k", linestyle="--", linewidth=1, label="no eviction")
    ax.set_xlabel("fraction of the prompt kept")
    ax.set_ylabel("accuracy (empirical)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, Path(path))


def bytes_vs_accuracy(points: Sequence[AccuracyPoint], dense_bytes: float, baseline: float, path: Path) -> Path:
    """Scatter of device-tier bytes per token (measured: codes, scales, witnesses, exact entries) against
    accuracy: gated green, raw red, peers (``gated=None``, e.g. transformers' QuantizedCache) blue, resident
    variants purple diamonds (their own legend entry), dense marked; points without bytes are left out."""
    fig, ax = plt.subplots(figsize=(6, 4))
    colours = {True: "tab:green", False: "tab:red", None: "tab:blue", "resident": "tab:purple"}
    names = {True: "gated", False: "raw", None: "peer", "resident": "resident (whole-context bytes)"}
    for p in points:
        if p.bytes_per_token is None:
            continue
        kind: bool | None | str = "resident" if p.resident else p.gated
        ax.scatter(
            p.bytes_per_token,
            p.accuracy,
            color=colours[kind],
            marker="D" if p.resident else "o",
            label=names.pop(kind, None),
        )
        ax.annotate(p.label, (p.bytes_per_token, p.accuracy), fontsize=6)
    ax.scatter([dense_bytes], [baseline], color="k", marker="*", s=80, label="dense (fp16)")
    ax.set_xlabel("device KV bytes per token at the end of the request, all layers (measured)")
    ax.set_ylabel("accuracy (empirical)")
    ax.set_title("memory vs accuracy", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def bound_scatter(x: torch.Tensor, y: torch.Tensor, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """Scatter of paired cells ``(x, y)`` (finite pairs only) with the diagonal ``y = x``."""
    if x.shape != y.shape:
        raise ValueError(f"x and y must be paired cells, got shapes {tuple(x.shape)} and {tuple(y.shape)}")
    keep = torch.isfinite(x) & torch.isfinite(y)
    xs, ys = x[keep].double().numpy(), y[keep].double().numpy()
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(xs, ys, s=3, alpha=0.4)
    top = float(max(xs.max(initial=0.0), ys.max(initial=0.0), 1e-6))
    ax.plot([0, top], [0, top], "k--", linewidth=1, label="y = x")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def codec_shares(
    bytes_per_token_head: Mapping[str, float],
    series: Mapping[str, Mapping[str, float]],
    path: Path,
    title: str,
    xlabel: str = "share of cells",
) -> Path:
    """Grouped horizontal bars: per codec (one row, ordered by its stored bytes per token and head, named with them)
    one bar per ``series`` (a share); a codec missing from a series has no bar there. The legend sits in a band
    above the first row, clear of the bars."""
    names = sorted(bytes_per_token_head, key=lambda n: (bytes_per_token_head[n], n))
    height = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(names) * max(1, len(series)) / 2 + 1.6))
    for i, (label, shares) in enumerate(series.items()):
        rows = [k for k, n in enumerate(names) if n in shares]
        ax.barh(
            [k + (i - (len(series) - 1) / 2) * height for k in rows],
            [shares[names[k]] for k in rows],
            height=height,
            label=label,
        )
    ax.set_yticks(range(len(names)), [f"{n} ({bytes_per_token_head[n]:g} B)" for n in names], fontsize=7)
    ax.set_ylim(len(names) - 0.5, -0.9 - 0.4 * len(series))  # inverted: the first row on top, the legend above it
    ax.set_xlim(0, 1)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9, wrap=True)
    ax.legend(fontsize=7, loc="upper right")
    return _save(fig, path)
