"""Question: where does the recall traffic of a resident set come from (layer, KV head, decode step, recall vs dense
fallback), and how much of the context does it page in per decode step?

SmolLM2-135M, RULER prompts (exact prefill shared through ``ingest``), ``CertifiedCache(gate=Gate.certified(tau),
eviction=EvictionConfig.resident_set(R, select=SnapKV))`` with the resident K/V codec given, greedy decode of the
sample's answer budget. Per read (decode step, layer): pages recalled per KV head, KV heads served by dense fallback,
and the page-in entries relative to the context's K/V entries (K and V of every token, every layer and KV head — the
ratio of the fp16 bytes when the host tier holds fp16; this model's host tier is float32, which doubles the bytes, not
the ratio). All numbers measured (empirical).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/resident_traffic.py --samples 2 --keys none --values none
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evict_ruler import decode, shared_prefill  # noqa: E402
from kvcert import EvictionConfig, Gate, StorageConfig  # noqa: E402
from kvcert.eval import load_task  # noqa: E402
from kvcert.eval.harness import prompt_ids  # noqa: E402
from kvcert.evict import SnapKV  # noqa: E402
from kvcert.integrations.transformers import CertifiedCache  # noqa: E402
from kvcert.models import converted_dir, load  # noqa: E402

#: the --options that configure the storage (the others configure the resident set)
STORAGE = {f.name for f in dataclasses.fields(StorageConfig)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="niah_single_1,niah_multikey_1")
    ap.add_argument("--samples", type=int, default=1, help="per task")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--resident", type=float, default=0.25)
    ap.add_argument("--tau", type=float, default=0.2)
    ap.add_argument("--keys", default="none")
    ap.add_argument("--values", default="none")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument(
        "--options",
        default="",
        help="StorageConfig or EvictionConfig.resident_set keywords, k=v,k=v (python literals)",
    )
    args = ap.parse_args()
    extra = {k: eval(v) for k, v in (kv.split("=", 1) for kv in args.options.split(",") if kv)}  # noqa: S307
    torch.set_num_threads(1)
    model, tok = load("smollm2-135m")
    model.eval()
    for task in args.tasks.split(","):
        for sample in load_task(task, args.context, args.samples, 0, converted_dir("smollm2-135m")):
            ids = prompt_ids(tok, sample)
            with torch.inference_mode():
                past, attentions, logits = shared_prefill(model, ids)
            first = logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            cache = CertifiedCache(
                model,
                gate=Gate.certified(args.tau),
                storage=StorageConfig(
                    keys=args.keys, values=args.values, **{k: v for k, v in extra.items() if k in STORAGE}
                ),
                eviction=EvictionConfig.resident_set(
                    args.resident,
                    select=SnapKV(window=32, kernel=5),
                    **{k: v for k, v in extra.items() if k not in STORAGE},
                ),
            )
            cache.ingest(past, attentions=attentions)
            with torch.inference_mode():
                toks = decode(model, cache, first, min(args.max_new, sample.max_new_tokens), tok.eos_token_id)
            recs = cache.resident_records
            cfg = model.config
            n_layers, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
            ctx_entries = ids.shape[1] * n_layers * hkv  # tokens x (layer, KV head)
            steps = sorted({r.step for r in recs})
            elt_tok = 2 * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) * 4
            print(
                f"\n{task} ({ids.shape[1]} tokens), R={args.resident}, tau={args.tau}, {args.keys}/{args.values}, "
                f"{extra}, {toks.shape[1]} new tokens, {len(steps)} decode steps, {time.perf_counter() - t0:.0f}s"
            )
            per_step_r = {s: 0 for s in steps}
            per_step_d = {s: 0 for s in steps}
            per_layer_r = [0] * n_layers
            per_layer_d = [0] * n_layers
            heads_dense = torch.zeros(n_layers, hkv)
            heads_rec = torch.zeros(n_layers, hkv)
            for r in recs:
                tr, td = r.bytes // elt_tok, r.bytes_dense // elt_tok
                per_step_r[r.step] += tr
                per_step_d[r.step] += td
                per_layer_r[r.layer] += tr
                per_layer_d[r.layer] += td
                heads_dense[r.layer] += r.head_dense[0].double()
                heads_rec[r.layer] += (r.head_pages[0] > 0).double()
            tot_r, tot_d = sum(per_step_r.values()), sum(per_step_d.values())
            n = max(len(steps), 1)
            print(
                f"per decode step, page-in entries / context entries: recall {tot_r / n / ctx_entries:.3f}, dense "
                f"fallback {tot_d / n / ctx_entries:.3f}; reads with recall {int(heads_rec.sum())}, dense "
                f"{int(heads_dense.sum())} of {n * n_layers * hkv} (KV-head reads)"
            )
            print(
                "step: recall / dense (share of context) "
                + " ".join(
                    f"{s}:{per_step_r[s] / ctx_entries * n_layers:.2f}/{per_step_d[s] / ctx_entries * n_layers:.2f}"
                    for s in steps[:12]
                )
            )
            print(
                "layer: recall+dense tokens per step / layer context (recall, dense heads of steps) "
                + " ".join(
                    f"L{i}:{per_layer_r[i] / n / (ids.shape[1] * hkv):.2f}"
                    f"+{per_layer_d[i] / n / (ids.shape[1] * hkv):.2f}"
                    f"({int(heads_rec[i].sum())},{int(heads_dense[i].sum())})"
                    for i in range(n_layers)
                )
            )
            tel = cache.telemetry()
            print(
                "resident share per layer (end of request) "
                + " ".join(f"L{i}:{f:.2f}" for i, f in enumerate(tel.layer_resident_fractions or ()))
            )
            print(
                f"device: capacity {tel.bytes_fp16_context / tel.bytes_device:.2f}x the context's fp16 K/V "
                f"(summary {tel.bytes_summary / tel.bytes_fp16_context:.3f}, held pages "
                f"{tel.bytes_held / tel.bytes_fp16_context:.3f} of it); page-in over the request "
                f"{tel.bytes_paged / tel.bytes_fp16_context:.3f}x its fp16 K/V bytes (host dtype bytes)"
            )
            cache.detach()


if __name__ == "__main__":
    main()
