"""Question: what does the request ledger cost per decode step at batch 8, as a ratio to the step?

A randomly initialised Llama with SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads;
timing does not depend on the weights), batch 8 with 8 different prompt lengths (left padded), then
``--steps`` greedy decode steps. Arms, measured side by side in one run (interleaved repetitions):

* ``certified``         ``kvcert.CertifiedCache`` (int8 K, int4 V, every cell certified), no observer
* ``certified+ledger``  the same cache with a :class:`LedgerObserver` recording into a :class:`Ledger`
* ``certified+ledger+log``  the same, every event committed to the SQLite WAL log (one transaction each)

Reports the median ms per decode step, the overhead ratio ``(arm − certified) / certified`` and the
time spent inside the ledger calls as a fraction of the step (measured directly, the less noisy number
on a shared machine). Target: <= 5%.
Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ledger_overhead.py``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from kvcert import CertifiedCache
from kvcert.cache.events import ReadEvent, WriteEvent
from kvcert.ledger import EventLog, Ledger, LedgerObserver


class _Timed:
    """Wraps an observer and accumulates the time spent inside it."""

    def __init__(self, inner: LedgerObserver) -> None:
        self.inner = inner
        self.seconds = 0.0

    def on_write(self, event: WriteEvent) -> None:
        t = time.perf_counter()
        self.inner.on_write(event)
        self.seconds += time.perf_counter() - t

    def on_read(self, event: ReadEvent) -> None:
        t = time.perf_counter()
        self.inner.on_read(event)
        self.seconds += time.perf_counter() - t


def _run(model, ids, mask, observer, steps: int) -> tuple[float, float]:
    """Prefill then ``steps`` decode steps; returns (median s/step, s inside the observer per step)."""
    b = ids.shape[0]
    cache = CertifiedCache(
        model,
        keys="int8",
        values="int4",
        request_ids=torch.arange(b),
        observers=[] if observer is None else [observer],
    )
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
        tok = out.logits[:, -1:].argmax(-1)
        inside0 = getattr(observer, "seconds", 0.0)
        times = []
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype)], 1)
            pos = pos[:, -1:] + 1
            t = time.perf_counter()
            out = model(input_ids=tok, attention_mask=mask, position_ids=pos, past_key_values=cache)
            tok = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t)
    cache.detach()
    inside = (getattr(observer, "seconds", 0.0) - inside0) / steps
    return statistics.median(times), inside


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=256, help="longest prompt (others shorter)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(cfg).eval()
    b = 8
    lengths = [args.context - 16 * i for i in range(b)]
    ids = torch.randint(0, cfg.vocab_size, (b, args.context))
    mask = torch.zeros((b, args.context), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, args.context - n :] = 1
    tmp = Path(tempfile.mkdtemp())
    base_arm = "certified"
    res: dict[str, list[tuple[float, float]]] = {
        base_arm: [],
        "certified+ledger": [],
        "certified+ledger+log": [],
    }
    for rep in tqdm(range(args.reps), desc="repetitions"):
        for arm in res:
            obs = None
            if arm != base_arm:
                log = EventLog(tmp / f"{rep}.db") if arm.endswith("+log") else None
                led = Ledger(log=log)
                for _ in range(b):
                    led.open_request()
                obs = _Timed(LedgerObserver(led))
            res[arm].append(_run(model, ids, mask, obs, args.steps))
    base = statistics.median(t for t, _ in res[base_arm])
    table = Table(
        title=f"ledger overhead per decode step (batch {b}, context <= {args.context}, "
        f"{args.steps} steps, median of {args.reps})"
    )
    for col in ("arm", "ms/step", f"ratio vs {base_arm}", "inside ledger ms/step", "inside / step"):
        table.add_column(col, justify="right", no_wrap=True)
    for arm, rows in res.items():
        t = statistics.median(x for x, _ in rows)
        inside = statistics.median(y for _, y in rows)
        table.add_row(
            arm,
            f"{t * 1e3:.2f}",
            f"{(t - base) / base:+.2%}",
            f"{inside * 1e3:.3f}",
            f"{inside / t:.2%}" if arm != base_arm else "-",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
