"""Question: when several questions about one long context are asked in turn, with the cache carried across
turns, how much does each eviction policy lose on the later turns?

SmolLM2-135M, RULER ``niah_multiquery`` (or any NIAH task whose question names several keys), generated
offline by ``kvcert.eval``. The sample's final question is split into one question per key
(``kvcert.eval.multiturn.split_queries``); turn 1 is the context plus the first question, each later turn
only its question, and the generated answers stay in the conversation (chat template, RULER answer
prefix per turn, greedy, at most ``--max-new`` tokens, stop at EOS). The cache is a ``CertifiedCache`` with
exact K/V (codec ``none``, ``certify=False``) in **decode-budget** mode: at most ``--budget`` (a fraction of
turn 1's tokens) slots per KV head, evicting as the conversation grows — so what a policy drops while
answering turn 1 is gone for turn 3. Turn 1's prefill is computed once, exactly, and ingested with its
recorded attention by every configuration (the first answer token comes from the exact prefill, as in
``evict_ruler.py``); the reference is the same path without eviction. RMM gets the emitted-token
probability as κ (free decoding). Per policy and turn: RULER's score of the turn's own needle, averaged
over samples. Every number is empirical.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/evict_multiturn.py --samples 1 --context 2048
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/evict_multiturn.py --samples 4 --seed 1 --out runs/mt   # shard
    .venv/bin/python benchmarks/evict_multiturn.py --report runs/mt          # pool shards, paired CIs

With ``--out DIR`` every sample's per-turn scores are appended to ``DIR/scores.jsonl`` as soon as they exist;
``--report`` pools every line (shards by seed) and adds, per policy, the paired bootstrap CI of the
per-sample mean over turns (and over the later turns 3+) against the reference.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from evict_ruler import answer_free, shared_prefill
from kvcert import EvictionConfig, ValidationConfig
from kvcert.eval import load_task, score
from kvcert.eval.multiturn import converse, dialogue_ids, split_queries
from kvcert.eval.stats import paired_bootstrap
from kvcert.evict import RMM, EvictionPolicy
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models import converted_dir, load

# evict_ruler's policies that read no answer trace, with RMM weighting by the emitted-token probability (free
# decoding, no references)
POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    **{name: make for name, make in answer_free().items() if not name.startswith("rmm")},
    "rmm(lag=32,emitted)": lambda: RMM(lag=32, kappa="emitted"),
}


def report(dirs: list[str]) -> None:
    """Pool ``scores.jsonl`` of the given runs (same task, context and budget) and print one table."""
    rows = [json.loads(line) for d in dirs for line in open(Path(d) / "scores.jsonl") if line.strip()]
    if not rows:
        raise SystemExit(f"no samples recorded in {dirs}")
    setups = {(r["task"], r["context"], r["budget"]) for r in rows}
    if len(setups) > 1:
        raise SystemExit(f"runs differ in task/context/budget: {sorted(setups)}")
    task, context, budget = setups.pop()
    names = list(rows[0]["scores"])
    n_turns = min(len(t) for r in rows for t in r["scores"].values())
    seeds = sorted({r["seed"] for r in rows})
    print(
        f"SmolLM2-135M, RULER {task} @ {context} split into {n_turns} turns, {len(rows)} samples (seeds "
        f"{', '.join(map(str, seeds))}), decode budget {budget:.0%} of turn 1, cache carried across turns "
        "(all numbers empirical; CIs: paired bootstrap over samples, 10^4 resamples)"
    )
    print(
        "| policy | "
        + " | ".join(f"turn {j + 1}" for j in range(n_turns))
        + " | mean [Δ vs reference, 95% CI] | turns 3+ [Δ, 95% CI] |"
    )
    print("|---|" + "---|" * (n_turns + 2))

    def mean_of(name: str, lo: int) -> list[float]:
        return [sum(r["scores"][name][lo:n_turns]) / (n_turns - lo) for r in rows]

    for name in names:
        per_turn = [sum(r["scores"][name][j] for r in rows) / len(rows) for j in range(n_turns)]
        cells = " | ".join(f"{v:.3f}" for v in per_turn)
        summary = []
        for lo in (0, 2):
            got = mean_of(name, lo)
            if name == "reference":
                summary.append(f"{sum(got) / len(got):.3f}")
                continue
            ci = paired_bootstrap(mean_of("reference", lo), got, seed=0)
            summary.append(f"{sum(got) / len(got):.3f} [{ci.diff:+.3f}, {ci.low:+.3f} to {ci.high:+.3f}]")
        print(f"| {name} | {cells} | {summary[0]} | {summary[1]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="niah_multiquery")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, default=0.5, help="slots per KV head, fraction of turn 1")
    parser.add_argument("--max-new", type=int, default=16, help="new tokens per turn (the needle is 7 digits)")
    parser.add_argument("--out", default=None, help="directory for scores.jsonl (one line per sample)")
    parser.add_argument("--report", nargs="+", default=None, help="pool saved runs and print the table")
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    log = None
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        log = open(Path(args.out) / "scores.jsonl", "a")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, tok = load("smollm2-135m")
    model.eval()
    samples = load_task(args.task, args.context, args.samples, args.seed, converted_dir("smollm2-135m"))
    names = ["reference", *POLICIES]
    scores: dict[str, list[list[float]]] = {name: [] for name in names}
    budgets = []
    t0 = time.perf_counter()
    for sample in tqdm(samples, desc="samples"):
        turns = split_queries(sample)
        segments = dialogue_ids(tok, turns)
        past, attentions, logits = shared_prefill(model, segments[0])
        budget = int(args.budget * segments[0].shape[1])
        budgets.append(budget)
        for name in names:
            eviction = None if name == "reference" else EvictionConfig.decode_budget(POLICIES[name](), budget)
            uncertified = ValidationConfig(certify=False)
            cache = CertifiedCache(model, keys="none", values="none", validation=uncertified, eviction=eviction)
            cache.ingest(past, attentions=attentions if eviction is not None else None)
            conv = converse(model, cache, segments, args.max_new, [tok.eos_token_id], first_logits=logits[:, -1])
            cache.detach()
            scores[name].append(
                [score(t, tok.decode(x, skip_special_tokens=True)) for t, x in zip(turns, conv.tokens, strict=True)]
            )
        if log is not None:
            log.write(
                json.dumps(
                    {
                        "task": args.task,
                        "index": sample.index,
                        "seed": args.seed,
                        "context": args.context,
                        "budget": args.budget,
                        "slots": budget,
                        "scores": {name: scores[name][-1] for name in names},
                    }
                )
                + "\n"
            )
            log.flush()
    minutes = (time.perf_counter() - t0) / 60
    n_turns = min(len(s) for s in scores["reference"])
    print(
        f"SmolLM2-135M, RULER {args.task} @ {args.context} split into {n_turns} turns, {len(samples)} samples, "
        f"seed {args.seed}, decode budget {args.budget:.0%} of turn 1 ({min(budgets)}-{max(budgets)} slots per "
        f"KV head), cache carried across turns, {minutes:.1f} min (all numbers empirical)"
    )
    print("| policy | " + " | ".join(f"turn {j + 1}" for j in range(n_turns)) + " | mean |")
    print("|---|" + "---|" * (n_turns + 1))
    for name in names:
        per_turn = [sum(s[j] for s in scores[name]) / len(samples) for j in range(n_turns)]
        cells = " | ".join(f"{v:.3f}" for v in per_turn)
        print(f"| {name} | {cells} | {sum(per_turn) / n_turns:.3f} |")


if __name__ == "__main__":
    main()
