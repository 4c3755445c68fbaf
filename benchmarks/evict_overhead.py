"""Question: what does an eviction policy cost per decode step, relative to the decode step itself?

A SmolLM2-135M-shaped Llama (30 layers, hidden 576, 9 query / 3 KV heads, random weights: the compute
per step is the real model's) decodes one token against a ``--context``-token ``DynamicCache`` (random
K/V; the cache is cropped back after each step). Side by side in one run, for every online policy, the
per-step policy work over all 30 layers: ``observe`` (one attention row ``[1, 3, 1, S+1]`` per layer),
``set_kappa``, ``select`` to the budget ``S`` (evicts one item per KV head) and ``on_evict``.
Computing the attention row itself (eager attention) is not included. Belady is offline (its table is
``T² · L · Hkv``) and not measured. Target: policy / decode <= 5 %.
Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/evict_overhead.py``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvcert.evict import H2O, RMM, EvictionPolicy, SnapKV, StreamingLLM

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def _model() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=LAYERS,
        num_attention_heads=9,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _decode_ms(model: LlamaForCausalLM, context: int, reps: int) -> list[float]:
    cache = DynamicCache()
    for layer in range(LAYERS):
        kv = torch.randn(1, KV_HEADS, context, HEAD_DIM)
        cache.update(kv, kv.clone(), layer)
    tok, pos = torch.tensor([[17]]), torch.tensor([[context]])
    times = []
    with torch.no_grad():
        for _ in range(reps):
            t0 = time.perf_counter()
            model(tok, past_key_values=cache, position_ids=pos, use_cache=True)
            times.append((time.perf_counter() - t0) * 1e3)
            cache.crop(-1)
    return times


def _policy_ms(policy: EvictionPolicy, context: int, reps: int) -> list[float]:
    g = torch.Generator().manual_seed(1)
    rows = torch.softmax(
        torch.randn(reps + 1, LAYERS, 1, KV_HEADS, 1, context + 1, generator=g, dtype=torch.float64), -1
    )
    positions = [torch.arange(context).expand(1, KV_HEADS, context) for _ in range(LAYERS)]
    times = []
    for step in range(reps + 1):  # step 0 warms the state up (first observe of a long context)
        now = context + step
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            positions[layer] = torch.cat([positions[layer], torch.full((1, KV_HEADS, 1), now)], -1)
            policy.observe(layer, rows[step, layer], positions[layer])
        policy.set_kappa(torch.tensor([[now]]), torch.tensor([[0.5]], dtype=torch.float64))
        for layer in range(LAYERS):
            keep = policy.select(layer, context)
            if keep is not None:
                positions[layer] = positions[layer].gather(-1, keep)
                policy.on_evict(layer, keep)
        if step:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = _model()
    policies: dict[str, EvictionPolicy] = {
        "StreamingLLM(sinks=4)": StreamingLLM(sinks=4),
        "H2O(recent=64)": H2O(recent=64),
        "SnapKV(window=32, kernel=5)": SnapKV(window=32, kernel=5),
        "RMM(lag=64)": RMM(lag=64),
    }
    decode: list[float] = []
    cost: dict[str, list[float]] = {name: [] for name in policies}
    for _ in tqdm(range(3), desc="interleaved rounds"):
        decode += _decode_ms(model, args.context, args.reps)
        for name, policy in policies.items():
            policy.reset()
            cost[name] += _policy_ms(policy, args.context, args.reps)
    base = statistics.median(decode)
    table = Table(title=f"per-step policy overhead, {LAYERS} layers x {KV_HEADS} KV heads, context {args.context}")
    for col in ("what", "median ms/step", "ratio to decode step"):
        table.add_column(col)
    table.add_row("decode step (SmolLM2-135M shape)", f"{base:.2f}", "1.000")
    for name, times in cost.items():
        med = statistics.median(times)
        table.add_row(name, f"{med:.2f}", f"{med / base:.3f}")
    Console().print(table)


if __name__ == "__main__":
    main()
