"""Question: how much RULER needle accuracy does each eviction policy keep at 25/50/75 % of the prompt?

SmolLM2-135M, RULER needle tasks, greedy decoding, prefill compression inside ``CertifiedCache``
(``evict=policy, compression_ratio=1 − keep``, kvpress convention; decode tokens are not evicted). One exact
prefill per sample is shared by every configuration: its K/V (a ``DynamicCache``) and its causal attention
probabilities (recorded per layer, mean over each KV head's query heads) are handed to
``CertifiedCache.ingest(past, attentions=...)``, which compresses with them — the same scores the in-forward
path computes, without 13 prefills per sample. The first answer token comes from the exact prefill (as in
kvpress, compression happens after the prefill's own attention). K/V are stored exact (codec ``none``,
``certify=False``) so only eviction differs from the reference: the same ingest path without eviction, on
the same samples. RMM gets the realised κ of the prompt (next-token probabilities of the prefill).
Per policy and budget: accuracy, the paired bootstrap CI of the difference to the reference and the exact
McNemar p-value. Every number is empirical.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/evict_ruler.py --samples 4 --context 2048
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcert.eval import load_task
from kvcert.eval.harness import prompt_ids
from kvcert.eval.ruler import Sample, score
from kvcert.eval.stats import mcnemar, paired_bootstrap
from kvcert.evict import H2O, RMM, EvictionPolicy, SnapKV, StreamingLLM, token_probability
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models import converted_dir, load

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "streaming(sinks=4)": lambda: StreamingLLM(sinks=4),
    "h2o(recent=32)": lambda: H2O(recent=32),
    "snapkv(w=32,k=5)": lambda: SnapKV(window=32, kernel=5),
    "rmm(lag=32,realised)": lambda: RMM(lag=32, kappa="realised"),
}


_RECORDED: dict[int, torch.Tensor] = {}


def _recording_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA that also records the causal prefill attention ``[B, Hkv, S, S]`` (mean over each group)."""
    out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 **kwargs)
    b, hq, s, d = query.shape
    hkv = key.shape[1]
    logits = query.reshape(b, hkv, hq // hkv, s, d) @ key.unsqueeze(2).transpose(-1, -2) * scaling
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    _RECORDED[module.layer_idx] = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).mean(2)
    return out


@torch.inference_mode()
def shared_prefill(model: PreTrainedModel, ids: torch.Tensor) -> tuple[DynamicCache, list[torch.Tensor],
                                                                          torch.Tensor]:
    """Exact prefill: (K/V cache, per-layer attention ``[1, Hkv, S, S]``, logits ``[1, S, V]``)."""
    AttentionInterface.register("evict-record", _recording_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation("evict-record")
    past = DynamicCache(config=model.config)
    try:
        logits = model(ids, past_key_values=past, use_cache=True, logits_to_keep=0).logits
    finally:
        model.set_attn_implementation(previous)
    attentions = [_RECORDED.pop(i) for i in range(len(past.layers))]
    return past, attentions, logits


@torch.inference_mode()
def decode(model: PreTrainedModel, cache: CertifiedCache, first: torch.Tensor, max_new: int, eos: int
           ) -> torch.Tensor:
    """Greedy tokens ``[1, n]`` starting with ``first`` (from the shared prefill), stopping at ``eos``."""
    toks = []
    nxt = first
    while len(toks) < max_new and int(nxt) != eos:
        toks.append(nxt)
        nxt = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
    return torch.cat(toks, 1) if toks else first[:, :0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", default="0.25,0.5,0.75", help="fractions of the prompt kept")
    parser.add_argument("--max-new", type=int, default=32, help="cap on new tokens (RULER budget if lower)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tok = load("smollm2-135m")
    model.eval()
    samples: list[Sample] = []
    for task in args.tasks.split(","):
        samples += load_task(task, args.context, args.samples, args.seed, converted_dir("smollm2-135m"))
    keeps = [float(k) for k in args.keep.split(",")]
    configs = [(name, k) for name in POLICIES for k in keeps]
    scores: dict[tuple[str, float], list[float]] = {c: [] for c in [("reference", 1.0), *configs]}
    t0 = time.perf_counter()
    for sample in tqdm(samples, desc="samples"):
        ids = prompt_ids(tok, sample)
        max_new = min(sample.max_new_tokens, args.max_new)
        past, attentions, logits = shared_prefill(model, ids)
        first = logits[:, -1:].argmax(-1)
        kappa = torch.ones(1, ids.shape[1], dtype=torch.float64)
        kappa[:, :-1] = token_probability(logits[:, :-1], ids[:, 1:])   # realised κ of the prompt
        del logits
        for name, keep in [("reference", 1.0), *configs]:
            kwargs = {} if name == "reference" else {"evict": POLICIES[name](), "compression_ratio": 1.0 - keep}
            cache = CertifiedCache(model, keys="none", values="none", certify=False, **kwargs)
            if kwargs:
                cache.set_prefill_kappa(kappa)
            cache.ingest(past, attentions=attentions if kwargs else None)
            toks = decode(model, cache, first, max_new, tok.eos_token_id)
            cache.detach()
            scores[(name, keep)].append(score(sample, tok.decode(toks[0], skip_special_tokens=True)))
    elapsed = time.perf_counter() - t0
    ref = scores[("reference", 1.0)]
    print(f"SmolLM2-135M, RULER {args.tasks} @ {args.context}, {len(samples)} samples, seed {args.seed}, "
          f"prefill compression via shared-prefill ingest, {elapsed / 60:.1f} min (all numbers empirical)")
    print("| policy | kept | accuracy | Δ vs reference [95% paired bootstrap CI] | McNemar p |")
    print("|---|---|---|---|---|")
    print(f"| reference (no eviction) | 100% | {sum(ref) / len(ref):.3f} | — | — |")
    for name, keep in configs:
        got = scores[(name, keep)]
        ci = paired_bootstrap(ref, got, seed=0)
        binary = all(v in (0.0, 1.0) for v in ref + got)
        p = f"{mcnemar(ref, got).p_exact:.3f}" if binary else "n/a (partial scores)"
        print(f"| {name} | {keep:.0%} | {sum(got) / len(got):.3f} | {ci.diff:+.3f} [{ci.low:+.3f}, {ci.high:+.3f}] "
              f"| {p} |")


if __name__ == "__main__":
    main()
