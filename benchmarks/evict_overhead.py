"""Question: what does an eviction policy cost per decode step, relative to the decode step itself?

A SmolLM2-135M-shaped Llama (30 layers, hidden 576, 9 query / 3 KV heads, random weights: the compute
per step is the real model's) decodes one token against a ``--context``-token ``DynamicCache`` (random
K/V; the cache is cropped back after each step). Side by side in one run, for every online policy and
every ``--chunks`` value, the per-step policy work over all 30 layers: ``observe`` (one attention row
``[1, 3, 1, S]`` per layer), ``set_kappa``, ``select(layer, budget=context, chunk)`` and ``on_evict``.
With ``chunk = 1`` every step evicts one item per KV head (the cache stays at exactly the budget); with
``chunk = c`` every ``c``-th step evicts ``c`` items (amortised, the mean over whole chunks is reported).
Timed: the policy calls only, not the harness's own bookkeeping of positions (the cache's gather of its
K/V is eviction's cost, not the policy's) nor producing the attention row. Clock: CPU time of this
thread (``time.thread_time``, single-threaded torch), so that other processes on a shared machine do not
count. Belady is offline (its table is ``T² · L · Hkv``) and not measured. Target: policy / decode <= 5 %.
Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/evict_overhead.py``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel

from kvcert.evict import H2O, RMM, EvictionPolicy, SnapKV, StreamingLLM
from kvcert.models.tiny import SMOLLM2_135M_SHAPE, tiny_random
from kvcert.report.tables import ReportTable, print_table

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def _model() -> PreTrainedModel:
    model = tiny_random("llama", attn_implementation="sdpa", **SMOLLM2_135M_SHAPE)
    assert (model.config.num_hidden_layers, model.config.num_key_value_heads) == (LAYERS, KV_HEADS)
    return model


def _decode_ms(model: PreTrainedModel, context: int, reps: int) -> list[float]:
    cache = DynamicCache()
    for layer in range(LAYERS):
        kv = torch.randn(1, KV_HEADS, context, HEAD_DIM)
        cache.update(kv, kv.clone(), layer)
    tok, pos = torch.tensor([[17]]), torch.tensor([[context]])
    times = []
    with torch.no_grad():
        for _ in range(reps):
            t0 = time.thread_time()
            model(tok, cache=cache, position_ids=pos, use_cache=True)
            times.append((time.thread_time() - t0) * 1e3)
            cache.crop(-1)
    return times


def _policy_ms(policy: EvictionPolicy, context: int, chunk: int, reps: int) -> list[float]:
    """Mean policy CPU ms per step over each whole chunk of ``chunk`` steps (``reps`` chunks)."""
    g = torch.Generator().manual_seed(1)
    positions = [torch.arange(context).expand(1, KV_HEADS, context) for _ in range(LAYERS)]
    per_chunk, spent = [], 0.0
    for step in range(reps * chunk + 1):  # step 0 warms the state up (first observe of a long context)
        now = context + step
        for layer in range(LAYERS):
            positions[layer] = torch.cat([positions[layer], torch.full((1, KV_HEADS, 1), now)], -1)
            row = torch.softmax(torch.randn(1, KV_HEADS, 1, positions[layer].shape[-1], generator=g).double(), -1)
            t0 = time.thread_time()
            policy.observe(layer, row, positions[layer])
            spent += time.thread_time() - t0
        t0 = time.thread_time()
        policy.set_kappa(torch.tensor([[now]]), torch.tensor([[0.5]], dtype=torch.float64))
        spent += time.thread_time() - t0
        for layer in range(LAYERS):
            t0 = time.thread_time()
            keep = policy.select(layer, context, chunk)
            if keep is not None:
                policy.on_evict(layer, keep)
            spent += time.thread_time() - t0
            if keep is not None:
                positions[layer] = positions[layer].gather(-1, keep)
        if step == 0:
            spent = 0.0
        elif step % chunk == 0:
            per_chunk.append(spent * 1e3 / chunk)
            spent = 0.0
    return per_chunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20, help="decode steps per round; chunks per round per policy")
    ap.add_argument("--chunks", default="1,16", help="eviction chunk sizes (comma separated)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = _model()
    policies: dict[str, Callable[[], EvictionPolicy]] = {
        "StreamingLLM(sinks=4)": lambda: StreamingLLM(sinks=4),
        "H2O(recent=64)": lambda: H2O(recent=64),
        "SnapKV(window=32, kernel=5)": lambda: SnapKV(window=32, kernel=5),
        "RMM(lag=64)": lambda: RMM(lag=64),
    }
    chunks = [int(c) for c in args.chunks.split(",")]
    decode: list[float] = []
    cost: dict[tuple[str, int], list[float]] = {(name, c): [] for name in policies for c in chunks}
    for _ in tqdm(range(3), desc="interleaved rounds"):
        decode += _decode_ms(model, args.context, args.reps)
        for name, c in cost:
            cost[(name, c)] += _policy_ms(policies[name](), args.context, c, max(2, args.reps // c))
    base = statistics.median(decode)
    cells = [("decode step (SmolLM2-135M shape)", "", f"{base:.2f}", "1.000")]
    for (name, c), times in cost.items():
        med = statistics.median(times)
        cells.append((name, str(c), f"{med:.2f}", f"{med / base:.3f}"))
    table = ReportTable(
        f"per-step policy overhead (CPU time), {LAYERS} layers x {KV_HEADS} KV heads, context {args.context}"
        " (empirical)",
        ("what", "chunk", "median ms/step", "ratio to decode step"),
        tuple(cells),
    )
    print_table(Console(), table)


if __name__ == "__main__":
    main()
