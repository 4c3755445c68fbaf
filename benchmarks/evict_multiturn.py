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
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from evict_ruler import POLICIES as RULER_POLICIES
from evict_ruler import shared_prefill
from kvcert.eval import load_task, score
from kvcert.eval.multiturn import converse, dialogue_ids, split_queries
from kvcert.evict import RMM, EvictionPolicy
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models import converted_dir, load

# evict_ruler's policies, with RMM weighting by the emitted-token probability (free decoding, no references)
POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    **{name: make for name, make in RULER_POLICIES.items() if not name.startswith("rmm")},
    "rmm(lag=32,emitted)": lambda: RMM(lag=32, kappa="emitted"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="niah_multiquery")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, default=0.5, help="slots per KV head, fraction of turn 1")
    parser.add_argument("--max-new", type=int, default=16, help="new tokens per turn (the needle is 7 digits)")
    args = parser.parse_args()
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
            kwargs = {} if name == "reference" else {"evict": POLICIES[name](), "budget": budget}
            cache = CertifiedCache(model, keys="none", values="none", certify=False, **kwargs)
            cache.ingest(past, attentions=attentions if kwargs else None)
            conv = converse(model, cache, segments, args.max_new, [tok.eos_token_id], first_logits=logits[:, -1])
            cache.detach()
            scores[name].append([score(t, tok.decode(x, skip_special_tokens=True))
                                 for t, x in zip(turns, conv.tokens, strict=True)])
    minutes = (time.perf_counter() - t0) / 60
    n_turns = min(len(s) for s in scores["reference"])
    print(f"SmolLM2-135M, RULER {args.task} @ {args.context} split into {n_turns} turns, {len(samples)} samples, "
          f"seed {args.seed}, decode budget {args.budget:.0%} of turn 1 ({min(budgets)}-{max(budgets)} slots per "
          f"KV head), cache carried across turns, {minutes:.1f} min (all numbers empirical)")
    print("| policy | " + " | ".join(f"turn {j + 1}" for j in range(n_turns)) + " | mean |")
    print("|---|" + "---|" * (n_turns + 1))
    for name in names:
        per_turn = [sum(s[j] for s in scores[name]) / len(samples) for j in range(n_turns)]
        cells = " | ".join(f"{v:.3f}" for v in per_turn)
        print(f"| {name} | {cells} | {sum(per_turn) / n_turns:.3f} |")


if __name__ == "__main__":
    main()
