"""Cost of the heterogeneous-memory probe relative to the forward pass it observes, per model configuration.

For each tiny random-weight configuration (8 configs, 7 architecture families), side by side in one run:

* forward: one plain ``model(input_ids)`` prefill (no cache);
* probe: ``probe_request`` on the same request — its own forward passes (capture / latent extraction / gate
  hooks), quantisation of the captured keys, per-cell Tier-A certificates, selector meters, chains, snapshot.

It also prints the acceptance-gate result and, per layer, the chain value, tier, verdict and dominant stage.

Usage: ``OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/probe_heterogeneous.py [--tokens 64]
[--repeats 5]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from kvcert.integrations.forget_gates import tiny_recurrent_model
from kvcert.integrations.live_probe.heterogeneous import probe_request
from kvcert.integrations.mla import tiny_deepseek_v3
from kvcert.models.tiny import SLIDING_SHAPES, tiny_random
from kvcert.probe import verify

CONFIGS = {
    "llama": lambda: tiny_random("llama", attn_implementation="sdpa"),
    "qwen2": lambda: tiny_random("qwen2", attn_implementation="sdpa"),
    "mistral (SWA 8)": lambda: tiny_random("mistral", attn_implementation="sdpa", **SLIDING_SHAPES["mistral"]),
    "gemma3 (sliding+global)": lambda: tiny_random("gemma3", attn_implementation="sdpa", **SLIDING_SHAPES["gemma3"]),
    "deepseek_v3 (MLA)": lambda: tiny_deepseek_v3(),
    "deepseek_v3 (MLA, q-LoRA)": lambda: tiny_deepseek_v3(q_lora_rank=16),
    "mamba2": lambda: tiny_recurrent_model("mamba2"),
    "qwen3_next (GDN + attn)": lambda: tiny_recurrent_model("qwen3_next"),
}


def _median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ids = torch.randint(0, 128, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    rows, chains = [], []
    for name, make in tqdm(CONFIGS.items(), desc="configs"):
        model = make()
        with torch.no_grad():
            model(ids)  # warm-up
            fwd = _median_ms(lambda m=model: m(ids, use_cache=False), args.repeats)
        res = probe_request(model, ids, run_id="bench", model_name=name)
        probe = _median_ms(lambda m=model, n=name: probe_request(m, ids, run_id="bench", model_name=n), args.repeats)
        gate = verify(res.snapshot)
        rows.append((name, fwd, probe, probe / fwd, gate.stage, len(res.snapshot.readings)))
        chains += [(name, c) for c in res.chains]
    print(f"\nprefill of {args.tokens} tokens, median of {args.repeats}, OMP_NUM_THREADS=1, CPU\n")
    print(f"| {'config':27} | forward ms | probe ms | probe/forward | gate | readings |")
    print(f"|{'-' * 29}|-----------:|---------:|--------------:|------|---------:|")
    for name, fwd, probe, ratio, stage, n in rows:
        print(f"| {name:27} | {fwd:10.2f} | {probe:8.2f} | {ratio:13.1f}x | {stage} | {n:8d} |")
    head = "| layer | path            | chain value | tier      | verdict     | dominant stage |"
    print(f"\n| {'config':27} {head}")
    print(f"|{'-' * 29}|------:|-----------------|------------:|-----------|-------------|----------------|")
    for name, c in chains:
        verdict = c.verdict or "(reading)"
        print(
            f"| {name:27} | {c.layer:5d} | {c.path:15} | {c.evaluation.value:11.4g} | {c.tier.value:9} | "
            f"{verdict:11} | {c.dominant_stage} |"
        )


if __name__ == "__main__":
    main()
