"""Question: what share of KV-head reads does each key form certify within τ, and at how many device bytes?

``--model`` (real weights, offline), ``--prompts`` windows of ``--tokens`` tokens of the calibration corpus (``kjv``,
as ``kvcert allocate`` takes them; never RULER's haystack), each decoded for ``--steps`` greedy tokens once per key
form of ``--forms`` (registry names, e.g. ``dither-int8+bypass2``: the outlier bypass keeps the 2 highest-energy RoPE
pairs per head exact) with ``--values`` values, gate off, so every read's certificate is recorded and none repaired.

Per form: the KV-head coverage at ``--tau`` (the share of decode reads whose Tier-A certificate is ``≤ τ`` in every
query head of the KV head: the reads ``Gate.certified(τ)`` at head granularity serves without a page-in;
**certified**), the informative fraction (cells whose unclipped meter is below 1; certified) and the device bytes
over the fp16 K/V at the end of the request (codes, scales, bypassed channels, witnesses; **measured**), averaged over
the prompts. Writes ``--plot`` (coverage against device bytes).
Run: ``OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/key_coverage.py --model smollm2-135m``.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console

from kvcert import CertifiedCache, StorageConfig
from kvcert.cli.common import CERTIFIED_TAU, load_model
from kvcert.cli.progress import progress_bar
from kvcert.eval.bit_calibration import calibration_ids, kv_head_certified
from kvcert.report.tables import ReportTable, print_table

FORMS = "dither-int8,dither-int8+bypass2,dither-int8+bypass8,dither-int6,dither-int6+bypass8"


def measure(model, ids: torch.Tensor, keys: str, values: str, steps: int, tau: float, seed: int) -> tuple[float, ...]:
    """``(certified reads, recorded reads, informative cells, recorded cells, device bytes, fp16 bytes)`` of one
    prompt decoded with ``keys`` / ``values``, gate off."""
    cache = CertifiedCache(model, seed=seed, storage=StorageConfig(keys=keys, values=values))
    try:
        model.generate(ids, cache=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    finally:
        cache.detach()
    tel = cache.telemetry()
    ok, rec = kv_head_certified(tel, tau)
    informative = (tel.raw[tel.recorded] < 1).sum()
    cells = tel.recorded.sum()
    return float(ok.sum()), float(rec.sum()), float(informative), float(cells), tel.bytes_device, tel.bytes_fp16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--forms", default=FORMS, help="key codecs, comma-separated (registry names)")
    ap.add_argument("--values", default="int4", help="value codec of every form")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--tau", type=float, default=CERTIFIED_TAU)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", metavar="PNG", help="also write coverage against device bytes as a figure")
    args = ap.parse_args()
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    torch.set_num_threads(1)
    loaded = load_model(args.model, args.seed)
    ids = calibration_ids(loaded.tokenizer, "kjv", args.tokens, args.prompts, args.seed)
    console = Console(width=max(100, Console().width))
    sums: dict[str, list[float]] = {}
    with progress_bar(f"{len(forms)} forms x {len(ids)} prompt(s)", len(forms) * len(ids), console) as tick:
        for i, form in enumerate(forms):
            for j, x in enumerate(ids):
                got = measure(loaded.model, x, form, args.values, args.steps, args.tau, args.seed)
                sums[form] = [a + b for a, b in zip(sums.get(form, [0.0] * 6), got, strict=True)]
                tick(i * len(ids) + j)
    rows = []
    points = []
    for form, (ok, rec, inf, cells, dev, fp16) in sums.items():
        share = dev / fp16
        rows.append((form, f"{ok / rec:.3f}", f"{inf / cells:.3f}", f"{share:.3f}", f"{1 / share:.2f}x"))
        points.append((form, share, ok / rec))
    print_table(
        console,
        ReportTable(
            f"key forms on {args.model} ({args.prompts} x {args.tokens} tokens of kjv, {args.steps} steps, "
            f"{args.values} values, gate off)",
            (
                "keys",
                f"KV-head coverage at tau={args.tau} (certified)",
                "informative (certified)",
                "device / fp16 K/V (measured)",
                "capacity (measured)",
            ),
            tuple(rows),
        ),
    )
    if args.plot:
        _plot(points, args.plot, f"{args.model}: certified KV-head coverage at tau = {args.tau} vs device bytes")
        console.print(f"plot: {args.plot}")


def _plot(points: list[tuple[str, float, float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, share, cov in points:
        ax.scatter(share, cov, color="tab:red" if "+bypass" in name else "tab:blue")
        ax.annotate(name, (share, cov), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("device bytes / fp16 K/V (measured)")
    ax.set_ylabel("KV-head reads certified within tau")
    ax.set_ylim(-0.03, 1.05)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
