"""Question: what does the request ledger cost per decode step at batch 8, as a ratio to the step?

A randomly initialised Llama with SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads;
timing does not depend on the weights), batch 8 with 8 different prompt lengths (left padded), then
``--steps`` greedy decode steps. Arms, measured side by side in one run (interleaved repetitions):

* ``certified``                ``kvcert.CertifiedCache`` (int8 K, int4 V, every cell certified), no observer
* ``+ledger``                  the same cache with a :class:`LedgerObserver` recording into a :class:`Ledger`
* ``+ledger+log (per event)``  the same, every event committed to the SQLite WAL log in its own transaction
* ``+ledger+log (group)``      the same, the log in background group-commit mode (writer thread)

Per arm: median wall and CPU (``time.process_time``, all threads) ms per decode step; the side-by-side CPU
ratio to ``certified`` (includes building the cache's events); and the direct measurement: main-thread CPU
inside the observer calls (``time.thread_time``) plus the CPU of the process's other threads during decode
(the group-commit writer), as a share of the step's CPU. CPU time is the number to read on a shared,
overloaded machine: wall time there mostly measures waiting for a core. Target: <= 5%.
``--write-block`` is the cache's encode block (default 16, the CertifiedCache default; 1 = every decode
step writes every layer). Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ledger_overhead.py``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from tqdm import tqdm

from kvcert import CertifiedCache, StorageConfig
from kvcert.cache.events import ReadEvent, WriteEvent
from kvcert.ledger import EventLog, Ledger, LedgerObserver
from kvcert.models.tiny import SMOLLM2_135M_SHAPE, tiny_random
from kvcert.report.tables import ReportTable, print_table


class _Timed:
    """Wraps an observer and accumulates the wall and main-thread CPU time spent inside it."""

    def __init__(self, inner: LedgerObserver) -> None:
        self.inner = inner
        self.wall = 0.0
        self.cpu = 0.0

    def on_write(self, event: WriteEvent) -> None:
        t, c = time.perf_counter(), time.thread_time()
        self.inner.on_write(event)
        self.wall += time.perf_counter() - t
        self.cpu += time.thread_time() - c

    def on_read(self, event: ReadEvent) -> None:
        t, c = time.perf_counter(), time.thread_time()
        self.inner.on_read(event)
        self.wall += time.perf_counter() - t
        self.cpu += time.thread_time() - c


@dataclass
class _Run:
    wall: float  # median s per decode step
    cpu: float  # median process CPU s per decode step
    inside_wall: float  # s per step inside the observer calls
    inside_cpu: float  # main-thread CPU s per step inside the observer calls
    other_cpu: float  # CPU s per step of the process's other threads (the group-commit writer)


def _run(model, ids, mask, observer: _Timed | None, steps: int, write_block: int, log: EventLog | None) -> _Run:
    """Prefill then ``steps`` decode steps."""
    b = ids.shape[0]
    cache = CertifiedCache(
        model,
        request_ids=torch.arange(b),
        observers=[] if observer is None else [observer],
        storage=StorageConfig(keys="int8", values="int4", write_block=write_block),
    )
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache)
        tok = out.logits[:, -1:].argmax(-1)
        if log is not None:
            log.flush()  # the prefill's events are not part of the decode measurement
        w0, c0 = (0.0, 0.0) if observer is None else (observer.wall, observer.cpu)
        walls, cpus = [], []
        proc0, main0 = time.process_time(), time.thread_time()
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype)], 1)
            pos = pos[:, -1:] + 1
            t, c = time.perf_counter(), time.process_time()
            out = model(input_ids=tok, attention_mask=mask, position_ids=pos, cache=cache)
            tok = out.logits[:, -1:].argmax(-1)
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
        if log is not None:
            log.flush()  # the writer's work for these steps is counted below
        other = (time.process_time() - proc0) - (time.thread_time() - main0)
    cache.detach()
    w1, c1 = (0.0, 0.0) if observer is None else (observer.wall, observer.cpu)
    return _Run(statistics.median(walls), statistics.median(cpus), (w1 - w0) / steps, (c1 - c0) / steps, other / steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=256, help="longest prompt (others shorter)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--write-block", type=int, default=16, help="CertifiedCache write_block")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = tiny_random("llama", attn_implementation="sdpa", **SMOLLM2_135M_SHAPE)
    cfg = model.config
    b = 8
    lengths = [args.context - 16 * i for i in range(b)]
    ids = torch.randint(0, cfg.vocab_size, (b, args.context))
    mask = torch.zeros((b, args.context), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, args.context - n :] = 1
    tmp = Path(tempfile.mkdtemp())
    base_arm = "certified"
    arms = {base_arm: None, "+ledger": None, "+ledger+log (per event)": False, "+ledger+log (group)": True}
    res: dict[str, list[_Run]] = {arm: [] for arm in arms}
    for rep in tqdm(range(args.reps), desc="repetitions"):
        for arm, background in arms.items():
            obs, log = None, None
            if arm != base_arm:
                log = None if background is None else EventLog(tmp / f"{rep}-{background}.db", background=background)
                led = Ledger(log=log)
                for _ in range(b):
                    led.open_request()
                obs = _Timed(LedgerObserver(led))
            res[arm].append(_run(model, ids, mask, obs, args.steps, args.write_block, log))
            if log is not None:
                log.close()
    base_cpu = statistics.median(r.cpu for r in res[base_arm])
    cols = (
        "arm",
        "wall ms",
        "CPU ms",
        f"CPU vs {base_arm}",
        "ledger CPU ms",
        "ledger CPU / step CPU",
        "ledger wall / step wall",
        "other threads CPU ms",
    )
    cells: list[tuple[str, ...]] = []
    for arm, rows in res.items():
        med = {f: statistics.median(getattr(r, f) for r in rows) for f in _Run.__dataclass_fields__}
        ledger_cpu = med["inside_cpu"] + max(med["other_cpu"], 0.0)
        cells.append(
            (
                arm,
                f"{med['wall'] * 1e3:.1f}",
                f"{med['cpu'] * 1e3:.1f}",
                f"{(med['cpu'] - base_cpu) / base_cpu:+.2%}",
                "-" if arm == base_arm else f"{ledger_cpu * 1e3:.2f}",
                "-" if arm == base_arm else f"{ledger_cpu / med['cpu']:.2%}",
                "-" if arm == base_arm else f"{med['inside_wall'] / med['wall']:.2%}",
                f"{med['other_cpu'] * 1e3:.2f}",
            )
        )
    title = (
        f"ledger overhead per decode step (batch {b}, context <= {args.context}, write_block "
        f"{args.write_block}, {args.steps} steps, median of {args.reps}; tier: empirical timing)"
    )
    print_table(Console(), ReportTable(title, cols, tuple(cells)))


if __name__ == "__main__":
    main()
