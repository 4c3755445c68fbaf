"""Question: how tight is the omitted-mass bound of a resident set on a real model, per page summary and policy?

SmolLM2-135M, one RULER prompt (exact prefill shared through ``ingest``), ``CertifiedCache(gate=Gate.off(),
validate=True, eviction=EvictionConfig.resident_set(R, select=policy, summary=...))`` with exact K/V storage, a few
greedy decode steps. Per (decode step, layer, row, query head) cell: the certified bound ``m̄`` on the attention mass of
the omitted tokens (worst over the read's queries) against its exact value (validate mode), the share of cells whose
bound is ``<= tau`` (served without recall at ``Gate.certified(tau)``) against the share whose exact omitted mass is,
the summary's device bytes and the violations (must be 0). Bound: **certified**; exact mass: **measured**.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/resident_bound.py --summaries box:16,box:4,int8:16
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/resident_bound.py --summaries int8:16,basis8:16,basis16:16,basis24:16

``--summaries``: comma-separated ``kind:page_size`` with ``kind`` any of ``SUMMARIES`` (box, int8, basis8 ...
basis32, basis8-t2). The bytes column counts every device byte of the summaries (for ``basis<r>`` the per-head
bases too).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evict_ruler import decode, prefilled_prompt, resident_args  # noqa: E402
from kvcert import EvictionConfig, Gate  # noqa: E402
from kvcert.attention.resident import SUMMARIES  # noqa: E402
from kvcert.evict import EvictionPolicy, SnapKV, StreamingLLM  # noqa: E402
from kvcert.integrations.transformers import CertifiedCache  # noqa: E402

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "snapkv(w=32,k=5)": lambda: SnapKV(window=32, kernel=5),
    "streaming(sinks=4)": lambda: StreamingLLM(sinks=4),
}


def main() -> None:
    ap = resident_args(__doc__)
    ap.add_argument("--steps", type=int, default=4, help="decode steps after the prefill")
    ap.add_argument("--summaries", default="box:16,int8:16", help="comma-separated summary:page_size")
    args = ap.parse_args()
    specs = [spec.split(":") for spec in args.summaries.split(",")]
    bad = [spec for spec in specs if len(spec) != 2 or spec[0] not in SUMMARIES or not spec[1].isdigit()]
    if bad:
        ap.error(f"--summaries takes kind:page_size with kind in {', '.join(SUMMARIES)}; got {bad}")
    pr = prefilled_prompt(args.task, args.context)
    model, tok, ids, past, attentions, first = pr.model, pr.tok, pr.ids, pr.past, pr.attentions, pr.first
    print(
        f"SmolLM2-135M, RULER {args.task} @ {args.context} ({ids.shape[1]} tokens), resident {args.resident}, "
        f"{args.steps} decode steps, exact K/V; bound certified, exact mass measured"
    )
    print(
        "| policy | summary | page | exact mass mean / median | bound mean / median | cells bound <= tau | "
        "cells exact <= tau | summary bytes / fp16 KV of omitted | violations | wall |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for summary, page in specs:
        for name, policy in POLICIES.items():
            t0 = time.perf_counter()
            cache = CertifiedCache(
                model,
                keys="none",
                values="none",
                gate=Gate.off(),
                validate=True,
                eviction=EvictionConfig.resident_set(
                    args.resident, select=policy(), page_size=int(page), summary=summary
                ),
            )
            cache.ingest(past, attentions=attentions)
            with torch.inference_mode():
                decode(model, cache, first, args.steps, tok.eos_token_id)
            tel = cache.telemetry()
            omitted = sum(layer.store.evicted["k"].view().numel() for layer in cache.layers)  # B·Hkv·N·D
            cache.detach()
            live = ~torch.isnan(tel.omitted_mass_bound)
            bound, exact = tel.omitted_mass_bound[live], tel.omitted_mass[live]
            share = tel.bytes_summary / (omitted * 2 * 2)
            print(
                f"| {name} | {summary} | {page} | {exact.mean():.3f} / {exact.median():.3f} | {bound.mean():.3f} / "
                f"{bound.median():.3f} | {(bound <= args.tau).double().mean():.3f} | "
                f"{(exact <= args.tau).double().mean():.3f} | {share:.3f} | {tel.recall_violations} | "
                f"{time.perf_counter() - t0:.0f}s |",
                flush=True,
            )


if __name__ == "__main__":
    main()
