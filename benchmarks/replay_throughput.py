"""Question: how fast does ``replay`` rebuild a ledger from a log of >= 10^7 events?

Generates a log of ``--events`` entry-level events (the ledger's unit: one entry written or read) packed
into ledger rows of ``--per-row`` entries (half write rows, half read rows, ``--requests`` accounts,
probabilistic writes with e-process factors), committed with ``executemany`` in large transactions.
Then times :func:`kvcert.ledger.replay` on it and prints rows/s and entry events/s.
Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/replay_throughput.py``
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from rich.console import Console
from tqdm import tqdm

from kvcert.ledger import EventLog, Ledger, replay
from kvcert.ledger.events import OpenRequest, Row
from kvcert.report.tables import ReportTable, print_table


def _rows(n_pairs: int, per_row: int, requests: int, rng: np.random.Generator) -> Iterator[Row]:
    states = np.full(per_row, 1, dtype=np.uint8).tobytes()
    factors = (-0.01 - 0.01 * rng.random(per_row)).tobytes()
    for i in range(n_pairs):
        uid = i % requests
        base = (i // requests) * per_row
        slots = np.arange(base, base + per_row, dtype=np.int64)
        meta_w = json.dumps([f"pool{uid}", 0, "probabilistic", False])
        owners = np.full(per_row, uid, dtype=np.int64).tobytes()
        yield ("write", meta_w, slots.tobytes(), owners, states, factors)
        ranges = np.array([[uid], [base], [1], [per_row]], dtype=np.int64).tobytes()
        meta_r = json.dumps([f"pool{uid}", 0, False, False])
        yield ("read", meta_r, ranges, np.array([-1], np.int64).tobytes(), None, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--events", type=int, default=10_000_000, help="entry-level events (>= 10^7)")
    ap.add_argument("--per-row", type=int, default=128)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=5000, help="row pairs per transaction")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp()) / "replay.db"
    log = EventLog(tmp, synchronous="OFF")
    Ledger(log=log)  # writes the metadata replay needs
    log.append_many(OpenRequest(u, 0.01) for u in range(args.requests))
    n_pairs = -(-args.events // (2 * args.per_row))  # round up: at least --events entry events
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    gen = _rows(n_pairs, args.per_row, args.requests, rng)
    for start in tqdm(range(0, n_pairs, args.chunk), desc="generate"):
        pairs = min(args.chunk, n_pairs - start)
        log.append_rows(next(gen) for _ in range(2 * pairs))
    log.close()
    t_gen = time.perf_counter() - t0
    rows = 2 * n_pairs + args.requests
    entries = 2 * n_pairs * args.per_row
    t0 = time.perf_counter()
    led = replay(tmp)
    t_replay = time.perf_counter() - t0
    s = led.summary()
    assert s["n_written"] + s["n_reads"] == entries, "replay lost events"
    table = ReportTable(
        f"replay throughput ({entries:,} entry events in {rows:,} rows, {args.per_row}/row)",
        ("phase", "seconds", "rows/s", "entry events/s"),
        (
            ("generate (executemany)", f"{t_gen:.1f}", f"{rows / t_gen:,.0f}", f"{entries / t_gen:,.0f}"),
            ("replay", f"{t_replay:.1f}", f"{rows / t_replay:,.0f}", f"{entries / t_replay:,.0f}"),
        ),
    )
    print_table(Console(), table)
    print(
        f"log size: {tmp.stat().st_size / 2**20:.1f} MiB; "
        f"e-process factors: {s['eprocess']['n_factors']:,}; max delta spent: {s['delta_spent_max']:.7g}"
    )


if __name__ == "__main__":
    main()
