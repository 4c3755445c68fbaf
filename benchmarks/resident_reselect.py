"""Question: what does re-selecting a resident set every N decode steps (``reselect=N``) move and page in, and does
every cell stay certified on a real model?

SmolLM2-135M, one RULER prompt (exact prefill shared through ``ingest``), ``CertifiedCache(gate=Gate.certified(tau),
validate=True, eviction=EvictionConfig.resident_set(R, select=policy, reselect=N))`` against the same cache without
re-selection, a fixed number of greedy decode steps; each re-selection ranks tokens by ``reselect_score`` (``--scores``:
the key proxy and / or the decode queries' attention). Per configuration: violations in validate mode (cells whose true
TV exceeded the certificate, plus omitted-mass and output-bound violations; must be 0), re-selections, tokens promoted,
their page-in bytes, all page-in bytes per decode step over the fp16 K/V of the context (both at fp16, 2 bytes per
entry, whatever the host dtype), whether the tokens equal the exact cache's, wall time. Counts and bytes: **measured**.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/resident_reselect.py --context 1024 --steps 12 --reselect off,4 \
        --scores key_proxy,decode
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evict_ruler import decode, prefilled_prompt, resident_args  # noqa: E402
from kvcert import EvictionConfig, Gate, ValidationConfig  # noqa: E402
from kvcert.evict import H2O, EvictionPolicy, SnapKV  # noqa: E402
from kvcert.integrations.transformers import CertifiedCache  # noqa: E402

#: (resident codec, policy) pairs: quantized and exact resident storage
CONFIGS: dict[str, tuple[str, Callable[[], EvictionPolicy]]] = {
    "int8 snapkv(w=32,k=5)": ("int8", lambda: SnapKV(window=32, kernel=5)),
    "none h2o(recent=32)": ("none", lambda: H2O(recent=32)),
}


def main() -> None:
    ap = resident_args(__doc__)
    ap.add_argument("--steps", type=int, default=12, help="decode steps after the prefill (no EOS stop)")
    ap.add_argument("--reselect", default="off,4,1", help="comma-separated N (or off) per run")
    ap.add_argument("--scores", default="key_proxy,decode", help="comma-separated reselect_score per N (not off)")
    args = ap.parse_args()
    pr = prefilled_prompt(args.task, args.context)
    model, ids, past, attentions, first = pr.model, pr.ids, pr.past, pr.attentions, pr.first
    exact = CertifiedCache(model, keys="none", values="none", validation=ValidationConfig(certify=False))
    exact.ingest(past)
    with torch.inference_mode():
        ref = decode(model, exact, first, args.steps, -1)
    exact.detach()
    print(
        f"SmolLM2-135M, RULER {args.task} @ {args.context} ({ids.shape[1]} tokens), resident {args.resident}, "
        f"certified({args.tau}), validate, {args.steps} decode steps; counts and bytes measured"
    )
    print(
        "| config | reselect | score | violations | re-selections | promoted | reselect page-in / step / fp16 KV | "
        "all page-in / step / fp16 KV | tokens = exact | wall |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (codec, policy) in CONFIGS.items():
        runs = [(spec, score) for spec in args.reselect.split(",") for score in args.scores.split(",")]
        for spec, score in dict.fromkeys((s, "-" if s == "off" else c) for s, c in runs):
            every = None if spec == "off" else int(spec)
            t0 = time.perf_counter()
            cache = CertifiedCache(
                model,
                keys=codec,
                values=codec,
                gate=Gate.certified(args.tau),
                validate=True,
                eviction=EvictionConfig.resident_set(
                    args.resident,
                    select=policy(),
                    reselect=every,
                    reselect_score="key_proxy" if score == "-" else score,
                ),
            )
            cache.ingest(past, attentions=attentions)
            with torch.inference_mode():
                toks = decode(model, cache, first, args.steps, -1)
            tel = cache.telemetry()
            host = cache.layers[0].store.k.host.dtype.itemsize
            cache.detach()
            stats = tel.reselect
            bad = tel.violations + tel.out_violations + tel.recall_violations
            steps, fp16 = max(toks.shape[1], 1), tel.bytes_fp16_context
            moved = stats.bytes_paged * 2 / host if stats is not None else 0.0
            print(
                f"| {name} | {spec} | {score} | {bad} | {stats.reselections if stats else 0} | "
                f"{stats.promoted if stats else 0} | {moved / steps / fp16:.3f} | "
                f"{tel.bytes_paged * 2 / host / steps / fp16:.3f} | {torch.equal(toks, ref)} | "
                f"{time.perf_counter() - t0:.0f}s |",
                flush=True,
            )


if __name__ == "__main__":
    main()
