"""Question: does each eviction policy keep the needle's tokens, and at which layers does it lose them?

Diagnostic for ``evict_ruler.py`` (why a policy loses a RULER needle): SmolLM2-135M, RULER needle tasks,
one exact prefill per sample (``evict_ruler.shared_prefill``: K/V and the recorded causal attention), then
every policy's prefill selection (``prefill_keep``, the same call ``CertifiedCache.ingest`` makes) at each
kept fraction. The needle's value tokens are located in the prompt from the tokenizer's character offsets
of every reference answer. Per (policy, kept): the fraction of (layer, KV head) cells that keep **all**
value tokens, the mean fraction of value tokens kept, and the worst layer (lowest mean). No decoding, so it
is cheap; every number is empirical.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/evict_needle_kept.py --samples 4 --context 2048
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from evict_ruler import answer_free, shared_prefill
from kvcert.eval import load_task
from kvcert.eval.harness import prompt_ids
from kvcert.eval.ruler import Sample
from kvcert.evict import token_probability
from kvcert.evict.base import prefill_kept_count
from kvcert.models import converted_dir, load
from kvcert.report.tables import ReportTable, print_table


def needle_positions(tok: PreTrainedTokenizerBase, sample: Sample, ids: torch.Tensor) -> torch.Tensor:
    """Token positions (sorted, unique) whose characters overlap any occurrence of a reference answer."""
    text = (
        tok.apply_chat_template(
            [{"role": "user", "content": sample.prompt}], add_generation_prompt=True, tokenize=False
        )
        + sample.answer_prefix
    )
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if enc.input_ids != ids[0].tolist():
        raise ValueError("offset tokenisation differs from prompt_ids; cannot locate the needle")
    spans = []
    for answer in sample.outputs:
        start = text.find(answer)
        while start >= 0:
            spans.append((start, start + len(answer)))
            start = text.find(answer, start + 1)
    if not spans:
        raise ValueError(f"no reference answer of sample {sample.index} occurs in its prompt")
    pos = [i for i, (a, b) in enumerate(enc.offset_mapping) if any(a < e and b > s for s, e in spans)]
    return torch.tensor(pos, dtype=torch.long)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", default="0.25,0.5,0.75")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tok = load("smollm2-135m")
    model.eval()
    samples = [
        s
        for task in args.tasks.split(",")
        for s in load_task(task, args.context, args.samples, args.seed, converted_dir("smollm2-135m"))
    ]
    keeps = [float(k) for k in args.keep.split(",")]
    n_layers = model.config.num_hidden_layers
    # per (policy, keep): [samples, layers, heads] fraction of value tokens kept
    kept_frac: dict[tuple[str, float], list[torch.Tensor]] = {}
    for sample in tqdm(samples, desc="samples"):
        ids = prompt_ids(tok, sample)
        needle = needle_positions(tok, sample, ids)
        past, attentions, logits = shared_prefill(model, ids)
        kappa = torch.ones(1, ids.shape[1], dtype=torch.float64)
        kappa[:, :-1] = token_probability(logits[:, :-1], ids[:, 1:])
        del logits
        s = ids.shape[1]
        for name, make in answer_free().items():
            for keep in keeps:
                policy = make()
                per_layer = []
                for layer in range(n_layers):
                    k, v = past.layers[layer].keys, past.layers[layer].values
                    idx = policy.prefill_keep(layer, k, v, 1.0 - keep, attn=attentions[layer], kappa=kappa)
                    mask = torch.zeros(*idx.shape[:2], s, dtype=torch.bool).scatter_(-1, idx, True)
                    assert idx.shape[-1] == prefill_kept_count(s, 1.0 - keep)
                    per_layer.append(mask[0][:, needle].double().mean(-1))  # [Hkv]
                kept_frac.setdefault((name, keep), []).append(torch.stack(per_layer))  # [layers, Hkv]
    cells: list[tuple[str, ...]] = []
    for (name, keep), fr in kept_frac.items():
        f = torch.stack(fr)  # [samples, layers, Hkv]
        by_layer = f.mean((0, 2))
        worst = int(by_layer.argmin())
        cells.append(
            (
                name,
                f"{keep:.0%}",
                f"{(f == 1).double().mean():.3f}",
                f"{f.mean():.3f}",
                f"{worst} ({by_layer[worst]:.3f})",
            )
        )
    table = ReportTable(
        f"needle value tokens kept, SmolLM2-135M, RULER {args.tasks} @ {args.context}, {len(samples)} samples "
        "(empirical)",
        ("policy", "kept", "cells keeping every value token", "mean value tokens kept", "worst layer"),
        tuple(cells),
    )
    print_table(Console(width=140), table)


if __name__ == "__main__":
    main()
