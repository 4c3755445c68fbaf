"""Question: does SmolLM2-135M retrieve RULER niah_single_2 needles at 2k context with the plain cache?

Runs the kvcert generation harness (RULER protocol: chat template + answer prefix, greedy, task budget)
with the uncompressed DynamicCache and prints accuracy and per-sample time.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/eval_smollm2_niah.py --samples 3 --context 2048
"""

from __future__ import annotations

import argparse
import time

from kvcert.eval import generate_answers, load_task
from kvcert.models import converted_dir, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    t0 = time.perf_counter()
    model, tok = load("smollm2-135m")
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    samples = load_task(args.task, args.context, args.samples, args.seed, converted_dir("smollm2-135m"))
    t_data = time.perf_counter() - t0
    preds = generate_answers(model, tok, samples)
    print(f"load {t_load:.1f} s | data {t_data:.1f} s")
    print(f"{'idx':>3} {'prompt tok':>10} {'new tok':>7} {'s':>6} {'score':>5}  answer / reference")
    for s, p in zip(samples, preds, strict=True):
        print(
            f"{p.index:>3} {p.prompt_tokens:>10} {p.new_tokens:>7} {p.seconds:>6.1f} {p.score:>5.2f}  "
            f"{p.text.strip()[:60]!r} / {list(s.outputs)}"
        )
    acc = sum(p.score for p in preds) / len(preds)
    mean_s = sum(p.seconds for p in preds) / len(preds)
    print(
        f"accuracy {acc:.3f} ({sum(p.score == 1.0 for p in preds)}/{len(preds)}) | "
        f"mean {mean_s:.1f} s/sample (empirical)"
    )


if __name__ == "__main__":
    main()
