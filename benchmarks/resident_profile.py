"""Question: where does the time of a resident-3x decode step go?

SmolLM2-135M (real weights, offline), one prompt of ``--context`` tokens of the Paul Graham essays, one exact prefill
recording what the resident set's policy reads, then ``--steps`` greedy decode steps of issue 16's 3x configuration
as ``benchmarks/decode_overhead.py`` runs it (``resident-3x``: fp16 resident keys, int4 values, SnapKV R = 0.2,
``--summary`` page summaries, swap recall, ``Gate.certified(0.2)``, device budget 1/3), ``--reps`` times after one
warm-up, start-up objects frozen out of the garbage collector. The process CPU time of each step is split by
timers wrapped around the cache's methods (nested ones are subtracted from their callers, so the parts add up):

* ``model`` — everything outside the cache's attention read (projections, MLP, sampling);
* ``resident read`` — the certified resident read: page bounds, recall, repair (``ResidentReadPath.read``);
* ``observe`` — the decode scores of the read (what a swap ranks by; ``DecodeScores.observe``);
* ``swap: move`` — promoting recalled pages into the resident set and demoting others (encode, carry);
* ``swap: summarise`` — re-sketching the archive after a move (basis, page spectra; ``EvictionDriver._summarize``);
* ``other read`` — the rest of ``CertifiedCache._read`` (writes, encode of the new token, checks).

Also printed: swaps per layer-step and ms per swap. All numbers empirical (CPU clock, single thread).
Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/resident_profile.py [--summary basis16-qspec]``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from tqdm import tqdm

from kvcert.attention.evict_driver import DecodeScores, EvictionDriver
from kvcert.attention.read_path import ResidentReadPath
from kvcert.eval.branching import exact_prefill, greedy_from
from kvcert.eval.corpora import load_corpus
from kvcert.integrations import transformers as integration
from kvcert.models import load
from kvcert.report.tables import ReportTable, print_table

_SPEC = importlib.util.spec_from_file_location(
    "decode_overhead", Path(__file__).resolve().parent / "decode_overhead.py"
)
assert _SPEC is not None and _SPEC.loader is not None
decode_overhead = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(decode_overhead)

#: (timer, owner, method): every timed method; the parts of the table are these minus what they call
TIMED: tuple[tuple[str, Any, str], ...] = (
    ("read", integration.CertifiedCache, "_read"),
    ("resident", ResidentReadPath, "read"),
    ("observe", DecodeScores, "observe"),
    ("swap", EvictionDriver, "swap"),
    ("summarise", EvictionDriver, "_summarize"),
)


class Clocks:
    """Process CPU time inside each wrapped method (:data:`TIMED`), and the calls of each."""

    def __init__(self) -> None:
        self.spent: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        for name, owner, method in TIMED:
            setattr(owner, method, self._timed(name, getattr(owner, method)))

    def _timed(self, name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[name] += time.process_time() - t0
                self.calls[name] += 1

        return timed

    def parts(self, step_total: float) -> dict[str, float]:
        """The table's exclusive parts (seconds): each timer minus the timers it contains."""
        s = self.spent
        swap_sum = s["summarise"]  # _summarize runs inside swap (its move) when swapping, and nowhere else here
        return {
            "model": step_total - s["read"],
            "resident read": s["resident"],
            "observe": s["observe"],
            "swap: move": s["swap"] - swap_sum,
            "swap: summarise": swap_sum,
            "other read": s["read"] - s["resident"] - s["observe"] - s["swap"],
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    summaries = [s.summary for s in decode_overhead.RESIDENT_3X.values()]
    ap.add_argument("--summary", choices=summaries, default=summaries[0], help="the omitted pages' summary")
    args = ap.parse_args()
    torch.set_num_threads(1)
    scheme = next(s for s in decode_overhead.RESIDENT_3X.values() if s.summary == args.summary)
    model, tok = load("smollm2-135m")
    ids = tok(load_corpus("pg-essays")[: args.context * 8], return_tensors="pt").input_ids[:, : args.context]
    prefill = exact_prefill(model, ids, scheme.prefill_reads)
    gc.collect()
    gc.freeze()
    clocks, rows = Clocks(), []
    layers = model.config.num_hidden_layers
    for rep in tqdm(range(args.reps + 1), desc="repetitions (the first warms up)"):
        cache = scheme.cache(model)
        cache.ingest(prefill.cache, prefill.attentions)
        clocks.spent, clocks.calls = Counter(), Counter()
        t0 = time.process_time()
        greedy_from(model, prefill.first, cache, args.steps, [])
        total = time.process_time() - t0
        cache.detach()
        if rep:
            moves = cache.telemetry().reselect
            rows.append((total, clocks.parts(total), 0 if moves is None else moves.reselections))
    steps = args.steps - 1  # greedy_from's first token comes from the prefill: steps − 1 forwards read the cache
    med_total = statistics.median(r[0] for r in rows) / steps
    names = list(rows[0][1])
    cells = []
    for name in names:
        ms = statistics.median(r[1][name] for r in rows) / steps * 1e3
        cells.append((name, f"{ms:.1f}", f"{ms / (med_total * 1e3):.1%}"))
    cells.append(("total", f"{med_total * 1e3:.1f}", "100%"))
    swaps = statistics.median(r[2] for r in rows)
    swap_ms = statistics.median((r[1]["swap: move"] + r[1]["swap: summarise"]) / max(r[2], 1) for r in rows) * 1e3
    table = ReportTable(
        f"resident-3x decode step ({scheme.summary}), SmolLM2-135M, context {args.context}, {steps} decode reads, "
        f"medians of {args.reps} (CPU clock, empirical); {swaps / (steps * layers):.0%} of layer reads swap, "
        f"{swap_ms:.1f} ms per swap",
        ("part", "ms/step", "share"),
        tuple(cells),
    )
    print_table(Console(width=140), table)


if __name__ == "__main__":
    main()
