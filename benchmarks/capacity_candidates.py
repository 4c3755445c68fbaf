"""Which gated scheme reaches certified capacity ≥ 3× on SmolLM2? Bytes per token, informative fraction and
KV-head coverage at τ = 0.2 of candidate key/value schemes on one RULER sample (issue 16, docs/results.md).

One exact prefill of the first sample of ``--task`` at ``--context`` tokens (SmolLM2-135M-Instruct), then per
scheme and per number of exact sink positions (``LayerStore.exact_sinks``) a ``CertifiedCache`` (gate off,
``--witness`` storage) ingests the prefill and decodes ``--new-tokens`` greedily. Prints per run: device bytes
per token (measured, ``Telemetry.bytes_device`` over prompt + generated tokens), capacity (fp16 / device), witness
bytes per token (measured), informative fraction (raw meter < 1) and KV-head coverage at τ = 0.2 (certified,
Tier A), and the RULER score of the continuation (empirical, one sample).

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/capacity_candidates.py --task niah_single_1
--schemes dither-int8/int4,dither-int6/kivi-2 [--sinks 0,4] [--new-tokens 8] [--witness log8]``
"""

from __future__ import annotations

import argparse
import time

import torch

from kvcert import StorageConfig
from kvcert.cache.gate import Gate
from kvcert.cli.common import load_model
from kvcert.eval import ruler
from kvcert.eval.branching import copy_cache, exact_prefill, greedy_from
from kvcert.eval.harness import prompt_ids
from kvcert.integrations.transformers import CertifiedCache

TAU = 0.2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="niah_single_1")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--schemes", default="dither-int8/int4,dither-int6/kivi-2", help="keycodec/valuecodec,...")
    ap.add_argument("--sinks", default="0", help="comma-separated numbers of exact sink positions")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--witness", default="log8", choices=("log8", "f32"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model("smollm2-135m", args.seed)
    sample = ruler.load_task(args.task, args.context, 1, args.seed, loaded.tokenizer_dir)[0]
    ids = prompt_ids(loaded.tokenizer, sample)
    prefill = exact_prefill(loaded.model, ids)
    pre, first = prefill.cache, prefill.first
    dense = loaded.tokenizer.decode(
        greedy_from(loaded.model, first, copy_cache(loaded.model, pre), args.new_tokens, loaded.eos_ids)
    )
    print(f"prompt {ids.shape[1]} tokens; dense: {dense!r} score {ruler.score(sample, dense)}")
    print(
        f"{'scheme':>20} {'sinks':>5} | {'dev B/tok':>9} {'capacity':>8} {'wit B/tok':>9} | "
        f"{'informative':>11} {'cov_kv@0.2':>10} | score"
    )
    for scheme in args.schemes.split(","):
        keys, _, values = scheme.partition("/")
        for sinks in (int(s) for s in args.sinks.split(",")):
            t0 = time.time()
            cache = CertifiedCache(
                loaded.model,
                gate=Gate.off(),
                seed=args.seed,
                storage=StorageConfig(keys=keys, values=values or keys, witness=args.witness),
            )
            for layer in cache.layers:
                layer.store.exact_sinks = sinks  # before the first write: positions < sinks stay exact
            cache.ingest(pre)
            toks = greedy_from(loaded.model, first, cache, args.new_tokens, loaded.eos_ids)
            cache.detach()
            tel = cache.telemetry()
            n = ids.shape[1] + len(toks)
            text = loaded.tokenizer.decode(toks)
            print(
                f"{scheme:>20} {sinks:>5} | {tel.bytes_device / n:>9.0f} {tel.capacity:>7.2f}× "
                f"{tel.bytes_witness / n:>9.0f} | "
                f"{tel.informative_fraction:>11.3f} {tel.coverage(TAU, 'kv_head'):>10.3f} | "
                f"{ruler.score(sample, text)} {text!r} ({time.time() - t0:.0f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
