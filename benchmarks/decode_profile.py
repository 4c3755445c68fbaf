"""Question: where does the certified decode step's extra time go — the attention read, or the garbage collector?

SmolLM2-135M (real weights, offline), one prompt of ``--context`` tokens, ``--steps`` greedy decode steps with
kvcert storage (int8 K + int4 V), uncertified (``certify=False``) and certified (every cell, gate off), in turn
per repetition. Per variant it reports the process CPU time per step, the part spent inside the cache's
attention read (``CertifiedCache._read``: certified read path, or plain SDPA for the uncertified variant) and
its share of the step, and the Python garbage-collector passes during the decode with their time (from
``gc.callbacks``) — first with the start-up objects in the collected generations, then after ``gc.freeze()``.
All numbers empirical. Run: ``.venv/bin/python benchmarks/decode_profile.py``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import Counter

import torch
from rich.console import Console
from tqdm import tqdm
from transformers import DynamicCache

from kvcert import CertifiedCache, ValidationConfig
from kvcert.eval.corpora import load_corpus
from kvcert.integrations import transformers as integration
from kvcert.models import load
from kvcert.report.tables import ReportTable, print_table


class _ReadClock:
    """Wraps ``CertifiedCache._read`` to add up the process CPU time spent inside it."""

    def __init__(self) -> None:
        self.spent = 0.0
        inner = integration.CertifiedCache._read

        def timed(cache, *args, **kwargs):
            t0 = time.process_time()
            try:
                return inner(cache, *args, **kwargs)
            finally:
                self.spent += time.process_time() - t0

        integration.CertifiedCache._read = timed


class _GcClock:
    """Counts collector passes per generation and their wall time while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.passes: Counter[int] = Counter()
        self.spent = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if not self.active:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.spent += time.perf_counter() - self._t0
            self.passes[info["generation"]] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per collector setting")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load("smollm2-135m")
    ids = tok(load_corpus("pg-essays")[: args.context * 8], return_tensors="pt").input_ids[:, : args.context]
    with torch.no_grad():
        pre = DynamicCache(config=model.config)
        first = model(ids, cache=pre, use_cache=True).logits[:, -1:].argmax(-1)
    reads, collector = _ReadClock(), _GcClock()
    rows = []
    for frozen in (False, True):
        if frozen:
            gc.collect()
            gc.freeze()
        for rep in tqdm(range(args.reps + 1), desc=f"{'frozen' if frozen else 'not frozen'} (first rep warms up)"):
            for certify in (False, True):
                cache = CertifiedCache(model, keys="int8", values="int4", validation=ValidationConfig(certify=certify))
                cache.ingest(pre)
                reads.spent, collector.spent, collector.passes = 0.0, 0.0, Counter()
                collector.active, tok_, t0 = True, first, time.process_time()
                with torch.no_grad():
                    for _ in range(args.steps):
                        tok_ = model(tok_, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
                step, collector.active = (time.process_time() - t0) / args.steps, False
                cache.detach()
                if rep:
                    rows.append(
                        (
                            frozen,
                            certify,
                            step,
                            reads.spent / args.steps,
                            collector.spent / args.steps,
                            dict(collector.passes),
                        )
                    )
    cells: list[tuple[str, ...]] = []
    for frozen in (False, True):
        for certify in (False, True):
            sel = [r for r in rows if r[0] == frozen and r[1] == certify]
            step, read, gcs = (statistics.median(r[i] for r in sel) * 1e3 for i in (2, 3, 4))
            cells.append(
                (
                    "frozen" if frozen else "collected",
                    "certified" if certify else "uncertified",
                    f"{step:.1f}",
                    f"{read:.2f}",
                    f"{read / step:.1%}",
                    f"{gcs:.2f} ({max(r[4] for r in sel) * 1e3:.2f})",
                    "; ".join(", ".join(f"g{g}:{n}" for g, n in sorted(r[5].items())) or "-" for r in sel),
                )
            )
    table = ReportTable(
        f"decode step anatomy, SmolLM2-135M, context {args.context}, {args.steps} steps, medians of {args.reps} "
        "(empirical)",
        (
            "start-up objects",
            "variant",
            "ms/step (CPU)",
            "read ms/step",
            "read share",
            "gc ms/step (worst rep)",
            "gc passes per gen (each rep)",
        ),
        tuple(cells),
    )
    print_table(Console(width=170), table)


if __name__ == "__main__":
    main()
