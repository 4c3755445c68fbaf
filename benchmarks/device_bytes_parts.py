"""Where do a gated scheme's device bytes go? RULER samples decoded through one scheme of
``benchmarks/capacity_ruler.py`` (the Tier-B box gate at τ = 0.2 on ``--block-size`` blocks, written back), and at
the end of each request every layer's :meth:`LayerStore.device_bytes_by_part <kvcert.cache.store.LayerStore.
device_bytes_by_part>`: light, heavy and single-codec codes, tier masks, upgrade records, exact entries (the tail
not yet encoded and the held ones) and witnesses, each measured from its tensors. The parts are summed over the
samples and shown per written token and KV head (the fp16 K/V of one is ``4·D`` bytes), with capacity; the table and
a stacked bar (``--plot``). Every number is measured (empirical); the reads are certified or partially certified.

Usage: ``OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/device_bytes_parts.py --scheme
dither-int5/int2 --upgrade dither-int8/int4 --heavy-share 0.3 --bands 2 --tasks niah_single_1,niah_multikey_1
--samples 2 --seed 761 [--model smollm2-135m] [--context 2048] [--block-size 1] [--plot PNG]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter
from pathlib import Path

import matplotlib
from rich.console import Console

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capacity_ruler import make_gate  # noqa: E402
from kvcert.cli.common import load_model, parse_heavy_values, parse_schemes  # noqa: E402
from kvcert.cli.progress import progress_bar  # noqa: E402
from kvcert.eval import ruler  # noqa: E402
from kvcert.eval.branching import Scheme, exact_prefill, greedy_from  # noqa: E402
from kvcert.eval.harness import prompt_ids  # noqa: E402
from kvcert.report.tables import ReportTable, print_table  # noqa: E402


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--scheme", required=True, help="KEYCODEC/VALUECODEC (light codecs with --heavy-share)")
    ap.add_argument("--upgrade", default=None, metavar="KEYCODEC/VALUECODEC")
    ap.add_argument("--heavy-share", type=float, default=None)
    ap.add_argument("--heavy-values", default=None, metavar="CODEC:SHARE")
    ap.add_argument("--bands", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=1)
    ap.add_argument("--tasks", required=True, help="comma-separated RULER tasks")
    ap.add_argument("--samples", type=int, default=1, help="samples per task")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    if args.upgrade is not None and len(args.upgrade.split("/")) != 2:
        ap.error(f"--upgrade takes KEYCODEC/VALUECODEC, got {args.upgrade!r}")
    if args.samples < 1 or args.bands < 1 or args.block_size < 1:
        ap.error("--samples, --bands and --block-size must be >= 1")
    return args


def main() -> None:
    args = _args()
    console = Console()
    (spec,) = parse_schemes(args.scheme)
    gate = dataclasses.replace(make_gate("block-box-tier-b"), block_size=args.block_size)
    upgrade = None if args.upgrade is None else tuple(args.upgrade.split("/"))
    scheme = Scheme(
        args.scheme,
        spec.keys,
        spec.values,
        gate,
        upgrade=upgrade,  # type: ignore[arg-type]
        heavy_share=args.heavy_share,
        heavy_values=parse_heavy_values(args.heavy_values),
        bands=args.bands,
    )
    loaded = load_model(args.model, args.seed)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    samples = [
        s for t in tasks for s in ruler.load_task(t, args.context, args.samples, args.seed, loaded.tokenizer_dir)
    ]
    parts: Counter[str] = Counter()
    fp16 = 0
    with progress_bar("requests", len(samples), console) as advance:
        for sample in samples:
            ids = prompt_ids(loaded.tokenizer, sample)
            pre = exact_prefill(loaded.model, ids, scheme.prefill_reads)
            cache = scheme.cache(loaded.model, args.seed)
            try:
                cache.ingest(pre.cache, pre.attentions)
                greedy_from(loaded.model, pre.first, cache, sample.max_new_tokens, loaded.eos_ids)
                for layer in cache.layers:
                    parts.update(layer.store.device_bytes_by_part())
                    fp16 += layer.store.bytes_fp16()
            finally:
                cache.detach()
            advance(1)
    head_dim = loaded.model.config.head_dim
    per = fp16 / (4 * head_dim)  # written (token, KV head) pairs
    rows = [(name, parts[name] / per) for name in sorted(parts) if parts[name]]
    total = sum(parts.values())
    cells = [(name, f"{value:.2f}", f"{value * per / total:.1%}") for name, value in rows]
    table = ReportTable(
        f"device bytes by part per written token and KV head ({scheme.name}, {len(samples)} requests, "
        f"fp16 K/V = {4 * head_dim} B)",
        ("part", "B", "share"),
        (*cells, ("all", f"{total / per:.2f}", f"capacity {fp16 / total:.3f}x")),
        "Tiers: every number measured (empirical), from the stored tensors.",
    )
    print_table(console, table)
    if args.plot is not None:
        fig, ax = plt.subplots(figsize=(10, 3.2))
        left = 0.0
        colors = plt.get_cmap("tab20").colors
        for i, (name, value) in enumerate(rows):
            ax.barh([0], [value], left=left, label=name, color=colors[i % len(colors)])
            left += value
        ax.set_yticks([])
        ax.set_xlabel(f"device bytes per written token and KV head (fp16: {4 * head_dim})")
        ax.set_title(f"{scheme.name}: capacity {fp16 / total:.2f}x (measured)")
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)
        console.print(f"figure: {args.plot}")


if __name__ == "__main__":
    main()
