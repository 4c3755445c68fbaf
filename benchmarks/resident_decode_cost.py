"""Question: what does a decode step cost on the recall path, against dense attention and the plain policy?

SmolLM2-135M, one RULER prompt, one exact prefill shared by every configuration (a ``DynamicCache`` copy for dense;
``CertifiedCache.ingest`` for the others), then ``--steps`` greedy decode steps per configuration, the
configurations interleaved ``--reps`` times. Per configuration: CPU seconds per decode step (``time.process_time``,
robust to other jobs on a shared box; wall time beside it) and the ratio to dense, side by side in one run:

* ``dense`` — ``DynamicCache``, every token, SDPA;
* ``plain snapkv`` — ``EvictionConfig.prefill(SnapKV, 1 − R)``, uncertified: the same resident
  set, the omitted tokens dropped, SDPA over the kept ones;
* ``recall persistent`` / ``recall transient`` — ``EvictionConfig.resident_set(R, select=SnapKV,
  recall=...)`` at ``Gate.certified(tau)``: the certified resident read (the eager reference path: no fused
  kernel) with page bounds and recall.

Timings are measured (empirical), single thread.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/resident_decode_cost.py --steps 8 --reps 2
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evict_ruler import prefilled_prompt, resident_args  # noqa: E402
from kvcert import EvictionConfig, Gate, ValidationConfig  # noqa: E402
from kvcert.attention.evict_driver import ingest_reads  # noqa: E402
from kvcert.evict import SnapKV  # noqa: E402
from kvcert.integrations.transformers import CertifiedCache  # noqa: E402


def main() -> None:
    ap = resident_args(__doc__)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    # SnapKV's prefill score reads the newest 32 query rows only
    pr = prefilled_prompt(args.task, args.context, ingest_reads(SnapKV(window=32, kernel=5)))
    model, ids, past, attentions, first = pr.model, pr.ids, pr.past, pr.attentions, pr.first

    def resident(recall: str) -> Callable[[], CertifiedCache]:
        def make() -> CertifiedCache:
            cache = CertifiedCache(
                model,
                keys="none",
                values="none",
                gate=Gate.certified(args.tau),
                eviction=EvictionConfig.resident_set(args.resident, select=SnapKV(window=32, kernel=5), recall=recall),
            )
            cache.ingest(past, attentions=attentions)
            return cache

        return make

    def plain() -> CertifiedCache:
        cache = CertifiedCache(
            model,
            keys="none",
            values="none",
            validation=ValidationConfig(certify=False),
            eviction=EvictionConfig.prefill(SnapKV(window=32, kernel=5), 1.0 - args.resident),
        )
        cache.ingest(past, attentions=attentions)
        return cache

    configs: dict[str, Callable[[], DynamicCache]] = {
        "dense": lambda: copy.deepcopy(past),
        "plain snapkv": plain,
        "recall persistent": resident("persistent"),
        "recall transient": resident("transient"),
    }
    cpu: dict[str, list[float]] = {k: [] for k in configs}
    wall: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(args.reps):
        for name, make in configs.items():
            cache = make()
            nxt = first
            with torch.inference_mode():
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.steps):  # fixed token count: no EOS stop, every config does the same work
                    nxt = model(nxt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
                cpu[name].append((time.process_time() - c0) / args.steps)
                wall[name].append((time.perf_counter() - t0) / args.steps)
            if isinstance(cache, CertifiedCache):
                cache.detach()
    base = min(cpu["dense"])
    print(
        f"SmolLM2-135M, RULER {args.task} @ {args.context} ({ids.shape[1]} tokens), resident {args.resident}, "
        f"tau {args.tau}, {args.steps} decode steps x {args.reps} reps, single thread (measured, empirical)"
    )
    print("| config | CPU ms / step (best of reps) | wall ms / step (best) | CPU vs dense |")
    print("|---|---|---|---|")
    for name in configs:
        print(f"| {name} | {1e3 * min(cpu[name]):.1f} | {1e3 * min(wall[name]):.1f} | {min(cpu[name]) / base:.2f}x |")


if __name__ == "__main__":
    main()
