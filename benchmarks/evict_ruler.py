"""Question: how much RULER needle accuracy does each eviction policy keep at 25/50/75 % of the prompt?

SmolLM2-135M, RULER needle tasks, greedy decoding, prefill compression inside ``CertifiedCache``
(``evict=policy, compression_ratio=1 − keep``, kvpress convention; decode tokens are not evicted). One exact
prefill per sample is shared by every configuration: its K/V (a ``DynamicCache``) and what the policies' prefill
scores read of its causal attention probabilities (recorded per layer in the same forward by
:func:`kvcert.eval.branching.exact_prefill`: SnapKV's window rows, H2O's column sums, every row for RMM's realised
κ) are handed to ``CertifiedCache.ingest(past, attentions=...)``, which compresses with them — the same scores the
in-forward path computes, without 13 prefills per sample. The first answer token comes from the exact prefill (as in
kvpress, compression happens after the prefill's own attention). K/V are stored exact (codec ``none``,
``certify=False``) so only eviction differs from the reference: the same ingest path without eviction, on
the same samples. RMM gets the realised κ of the prompt (next-token probabilities of the prefill).
Per policy and budget: accuracy, the paired bootstrap CI of the difference to the reference and the exact
McNemar p-value. Every number is empirical.

``belady(future_mass)`` is the clairvoyant selection: per (layer, KV head) it keeps the prompt items with the
most attention from the reference run's answer queries (the reads that produced the reference answer,
recorded by one forward of the reference tokens over the exact prefill; κ = 1). It knows the answer's reads,
which no deployable policy does; it is realisable (a kept set like any other) but not a proven accuracy
ceiling.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/evict_ruler.py --samples 4 --context 2048 --out runs/ev2k
    .venv/bin/python benchmarks/evict_ruler.py --report runs/ev2k runs/ev4k    # tables + plot from saved runs

``--recall TAU`` adds, for every policy and kept fraction, the recall-gated variant ``recall(τ,<summary>):<policy>``:
``EvictionConfig.resident_set(keep, select=policy, summary=...)`` gated ``Gate.certified(τ)`` (``--summary``, default
int8; ``docs/eviction.md``, "Resident set and recall") over the same ingested prefill — the same resident set as
the plain policy, the omitted tokens kept in the host tier and recalled page by page while a read's certificate
exceeds τ (exact storage, so the certificate is the omitted-mass bound plus float32 rounding). Its page-in cost
is recorded per sample (``recall`` in ``scores.jsonl``: bytes recalled or paged for dense fallback, decode reads,
fp16 KV bytes of the prompt) and reported as the mean page-in bytes per decode step relative to the prompt's
fp16 KV bytes. ``--reselect N`` re-selects the recall-gated variant's resident set every ``N`` decode steps
(``resident_set(reselect=N)``; ``docs/eviction.md``, "Re-selection of the resident set"); its promotions are part
of the page-in bytes and are also recorded apart (``reselect_paged``, ``promoted``). ``--recall-mode swap`` swaps the
pages each read paged in into the resident set (``resident_set(recall="swap")``; ``docs/eviction.md``); its
moves are recorded the same way. ``--resident-alloc mass``
splits the recall-gated variant's resident tokens across layers by the policy's prefill scores, the same total
(``resident_set(resident_alloc="mass")``; ``docs/eviction.md``, "Per-layer allocation of the resident set").

With ``--out DIR`` every sample's scores are appended to ``DIR/scores.jsonl`` as soon as they exist, so a
stopped run keeps what it measured and runs can be sharded; ``--policies`` runs a subset (the reference
always runs). ``--report`` pools runs per context length and merges the scores of one sample (same context,
seed, task and rank within its task) found in several runs; a reference score that differs between them is
an error.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial, reduce
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from kvcert import EvictionConfig, Gate, StorageConfig, ValidationConfig
from kvcert.attention.evict_driver import RESIDENT_ALLOCS, ingest_reads
from kvcert.attention.resident import RECALLS, SUMMARIES
from kvcert.eval import load_task
from kvcert.eval.attention_record import recorded_attention
from kvcert.eval.branching import exact_prefill
from kvcert.eval.harness import prompt_ids
from kvcert.eval.ruler import Sample, score
from kvcert.eval.stats import mcnemar, paired_bootstrap
from kvcert.evict import (
    EVERY_ROW,
    H2O,
    RMM,
    Belady,
    EvictionPolicy,
    PrefillAttention,
    PrefillReads,
    SnapKV,
    StreamingLLM,
    token_probability,
)
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models import converted_dir, load
from kvcert.report.figures import accuracy_vs_budget

POLICIES: dict[str, Callable[[torch.Tensor], EvictionPolicy]] = {  # argument: the answer trace (Belady only)
    "streaming(sinks=4)": lambda _: StreamingLLM(sinks=4),
    "h2o(recent=32)": lambda _: H2O(recent=32),
    "snapkv(w=32,k=5)": lambda _: SnapKV(window=32, kernel=5),
    "rmm(lag=32,realised)": lambda _: RMM(lag=32, kappa="realised"),
    "belady(future_mass)": lambda answer: Belady(
        answer, torch.ones(answer.shape[0]), variant="future_mass", first=answer.shape[-1] - answer.shape[0]
    ),
}


def answer_free() -> dict[str, Callable[[], EvictionPolicy]]:
    """The :data:`POLICIES` that read no answer trace (all but Belady), as factories of no argument: for the scripts
    that decode freely (``evict_multiturn.py``) or only select at prefill (``evict_needle_kept.py``)."""
    return {name: partial(make, torch.empty(0)) for name, make in POLICIES.items() if not name.startswith("belady")}


def shared_prefill(
    model: PreTrainedModel, ids: torch.Tensor, reads: PrefillReads = EVERY_ROW
) -> tuple[DynamicCache, list[PrefillAttention] | None, torch.Tensor]:
    """Exact prefill (:func:`kvcert.eval.branching.exact_prefill`): the K/V cache, what ``reads`` asks of each layer's
    causal attention, recorded in the same forward (``None`` when it asks nothing), and the logits ``[1, S, V]``."""
    pre = exact_prefill(model, ids, reads, logits_to_keep=0)
    return pre.cache, pre.attentions, pre.logits


@dataclass
class Prompt:
    """One RULER prompt after its exact prefill (:func:`shared_prefill`), for the single-prompt resident benchmarks."""

    model: PreTrainedModel
    tok: Any
    ids: torch.Tensor
    past: DynamicCache
    attentions: list[PrefillAttention] | None
    first: torch.Tensor  # the first answer token, from the prefill's logits


def resident_args(doc: str | None) -> argparse.ArgumentParser:
    """The options every single-prompt resident benchmark shares: task, context, resident fraction, tau."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="niah_single_1")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--resident", type=float, default=0.25)
    ap.add_argument("--tau", type=float, default=0.2)
    return ap


def prefilled_prompt(task: str, context: int, reads: PrefillReads = EVERY_ROW) -> Prompt:
    """SmolLM2-135M (single thread) and the first seed-0 sample of ``task`` at ``context``, prefilled exactly;
    ``reads``: what to record of the prefill attention (:func:`~kvcert.attention.evict_driver.ingest_reads` of the
    resident set's policy suffices)."""
    torch.set_num_threads(1)
    model, tok = load("smollm2-135m")
    model.eval()
    sample = load_task(task, context, 1, 0, converted_dir("smollm2-135m"))[0]
    ids = prompt_ids(tok, sample)
    with torch.inference_mode():
        past, attentions, logits = shared_prefill(model, ids, reads)
    return Prompt(model, tok, ids, past, attentions, logits[:, -1:].argmax(-1))


@torch.inference_mode()
def answer_trace(model: PreTrainedModel, past: DynamicCache, toks: torch.Tensor) -> torch.Tensor:
    """Attention ``[n, L, Hkv, S + n]`` of the answer queries (``toks[1, n]`` fed after the ``S``-token exact
    prefill ``past``, as the reference decode fed them); ``past`` is cropped back to ``S`` afterwards."""
    n = toks.shape[1]
    if n == 0:
        cfg = model.config
        return torch.empty(0, cfg.num_hidden_layers, cfg.num_key_value_heads, past.get_seq_length())
    try:
        with recorded_attention(model, EVERY_ROW) as recorded:
            model(toks, cache=past, use_cache=True, logits_to_keep=1)
    finally:
        past.crop(-n)
    return torch.stack([recorded[i].mean_newest(None)[0].transpose(0, 1) for i in range(len(past.layers))], 1)


@torch.inference_mode()
def decode(model: PreTrainedModel, cache: CertifiedCache, first: torch.Tensor, max_new: int, eos: int) -> torch.Tensor:
    """Greedy tokens ``[1, n]`` starting with ``first`` (from the shared prefill), stopping at ``eos``."""
    toks = []
    nxt = first
    while len(toks) < max_new and int(nxt) != eos:
        toks.append(nxt)
        nxt = model(nxt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
    return torch.cat(toks, 1) if toks else first[:, :0]


def table(context: int, rows: list[dict[str, Any]], configs: list[tuple[str, float]]) -> list[str]:
    """Markdown table of one context length: accuracy, paired bootstrap CI and McNemar p per configuration."""
    ref = [r["scores"]["reference@1.00"] for r in rows]
    tasks = sorted({r["task"] for r in rows})
    lines = [
        f"SmolLM2-135M, RULER {','.join(tasks)} @ {context}, {len(rows)} samples, prefill compression via "
        "shared-prefill ingest (all numbers empirical)",
        "| policy | kept | accuracy | Δ vs reference [95% paired bootstrap CI] | McNemar p |",
        "|---|---|---|---|---|",
        f"| reference (no eviction) | 100% | {sum(ref) / len(ref):.3f} | — | — |",
    ]
    for name, keep in configs:
        got = [r["scores"][f"{name}@{keep:.2f}"] for r in rows]
        ci = paired_bootstrap(ref, got, seed=0)
        binary = all(v in (0.0, 1.0) for v in ref + got)
        p = f"{mcnemar(ref, got).p_exact:.2g}" if binary else "n/a (partial scores)"
        lines.append(
            f"| {name} | {keep:.0%} | {sum(got) / len(got):.3f} | {ci.diff:+.3f} [{ci.low:+.3f}, "
            f"{ci.high:+.3f}] | {p} |"
        )
    return lines


PARTS = ("keys", "values")  # the recalled bytes, apart


def _per_step(got: list[dict[str, Any]], fields: list[str]) -> str:
    """``"a, b"``: each of ``fields`` per decode step over the context's fp16 K/V, mean over ``got``; "–" when a
    configuration's rows do not all record them."""
    if not all(f in c for c in got for f in fields):
        return "–"
    part = [sum(c[f] / max(c["steps"], 1) / c["fp16"] for c in got) / len(got) for f in fields]
    return ", ".join(f"{x:.3f}" for x in part)


def recall_cost(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines per recall-gated configuration (all measured): recalled bytes per decode step and all page-in
    bytes per decode step (recall + resident entries read exact + dense fallback), both counted at fp16 (2 bytes
    per K/V entry, whatever the host tier's dtype) over the fp16 K/V bytes of the whole context (every written
    token, resident or omitted); device capacity = that fp16 K/V / the device bytes at the end (resident codes,
    summaries, held pages), its mean and its range over the samples, and the device bytes less the held pages over
    that fp16 K/V (what persistent recall cannot hand back: above ``--device-budget`` the budget cannot bind). The
    recalled bytes split into keys and values (mean per step; key-first recall pages in the values of only some of
    the pages whose keys it reads), the rest of the page-in into resident entries read exact and dense fallbacks
    (mean per step); rows written before a split show "–" there."""
    names = sorted({k for r in rows for k in r.get("recall", {}) if "recalled" in r["recall"][k]})
    if not names:
        return []
    lines = [
        "| recall-gated config | recalled / step / fp16 KV of the context (mean, max) | of which keys, values (mean) "
        "| all page-in / step (mean, max) | of which exact resident, dense (mean) "
        "| device capacity (mean; min–max over the samples) | device without held pages / fp16 KV (mean, max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in names:
        got = [c for r in rows if (c := r.get("recall", {}).get(key))]
        rec = [c["recalled"] / max(c["steps"], 1) / c["fp16"] for c in got]
        paged = [c["paged"] / max(c["steps"], 1) / c["fp16"] for c in got]
        cap = [c["fp16"] / c["device"] for c in got]
        split, rest = (
            _per_step(got, [f"recalled_{p}" for p in PARTS]),
            _per_step(got, ["exact", "dense"]),
        )
        fixed = "–"
        if all("held" in c for c in got):
            base = [(c["device"] - c["held"]) / c["fp16"] for c in got]
            fixed = f"{sum(base) / len(base):.4f}, {max(base):.4f}"
        lines.append(
            f"| {key} | {sum(rec) / len(rec):.3f}, {max(rec):.3f} | {split} "
            f"| {sum(paged) / len(paged):.3f}, {max(paged):.3f} | {rest} "
            f"| {sum(cap) / len(cap):.2f}x ({min(cap):.2f}–{max(cap):.2f}) | {fixed} |"
        )
    return lines


def merged_rows(dirs: list[str]) -> list[dict[str, Any]]:
    """Rows of the runs' ``scores.jsonl``, one per sample: the scores of one sample (same context, seed, task
    and rank within its task in its run) from several runs are merged; their reference scores must agree."""
    merged: dict[tuple[int, int, str, int], dict[str, Any]] = {}
    for d in dirs:
        rank: dict[tuple[int, int, str], int] = {}
        for line in open(f"{d}/scores.jsonl"):
            if not line.strip():
                continue
            row = json.loads(line)
            group = (row["context"], row["seed"], row["task"])
            rank[group] = rank.get(group, -1) + 1
            key = (*group, rank[group])
            if key not in merged:
                merged[key] = row
                continue
            held = merged[key]["scores"]
            if held["reference@1.00"] != row["scores"]["reference@1.00"] or merged[key]["tokens"] != row["tokens"]:
                raise SystemExit(f"{d}: sample {key} disagrees with an earlier run (reference score or length)")
            held.update(row["scores"])
            merged[key].setdefault("recall", {}).update(row.get("recall", {}))
    return list(merged.values())


def report(dirs: list[str]) -> None:
    """Pool the runs per context length (``merged_rows``); print the tables and write ``accuracy-<context>.png``
    (accuracy vs kept fraction with paired CIs) into the first run's directory. A configuration enters a
    table only if every sample of that context has it."""
    rows = merged_rows(dirs)
    if not rows:
        raise SystemExit(f"no samples recorded in {dirs}")
    for context in sorted({r["context"] for r in rows}):
        mine = [r for r in rows if r["context"] == context]
        keys = [k for k in mine[0]["scores"] if not k.startswith("reference@")]
        keys += sorted({k for r in mine for k in r["scores"]} - set(keys) - {"reference@1.00"})
        partial = [k for k in keys if any(k not in r["scores"] for r in mine)]
        if partial:
            print(f"left out at {context} (not run on every sample): {', '.join(partial)}")
        configs = [(k.rsplit("@", 1)[0], float(k.rsplit("@", 1)[1])) for k in keys if k not in partial]
        print("\n".join(table(context, mine, configs) + recall_cost(mine)) + "\n")
        series = {}
        for name, keep in configs:
            acc = [r["scores"][f"{name}@{keep:.2f}"] for r in mine]
            ci = paired_bootstrap([r["scores"]["reference@1.00"] for r in mine], acc, seed=0)
            series.setdefault(name, []).append((keep, sum(acc) / len(acc), ci.low, ci.high))
        ref = sum(r["scores"]["reference@1.00"] for r in mine) / len(mine)
        path = accuracy_vs_budget(
            series,
            ref,
            Path(dirs[0]) / f"accuracy-{context}.png",
            f"SmolLM2-135M, RULER @ {context}, n = {len(mine)} (empirical)",
        )
        print(f"plot: {path}")


def check_args(args: argparse.Namespace) -> None:
    """Refuse unknown policies, and a ``--reselect`` or ``--resident-alloc`` that cannot run (``SystemExit`` with the
    reason)."""
    unknown = sorted(set(args.policies + (args.recall_policies or [])) - set(POLICIES))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; known: {'  '.join(POLICIES)}")
    if args.reselect is not None and (args.recall is None or args.reselect < 1):
        raise SystemExit("--reselect N needs --recall TAU and N >= 1 (it re-selects the recall-gated resident set)")
    if args.reselect is not None and any(n.startswith("belady") for n in args.recall_policies or args.policies):
        raise SystemExit("--reselect cannot re-select with belady: its answer trace covers the prompt only")
    if args.resident_alloc != "uniform":
        if args.recall is None:
            raise SystemExit("--resident-alloc splits the recall-gated resident set: it needs --recall TAU")
        # belady's scores come from its answer trace (built per sample), never from the prefill attention
        scoreless = [
            n
            for n in args.recall_policies or args.policies
            if n.startswith("belady") or not POLICIES[n](torch.empty(0)).needs_attention
        ]
        if scoreless:
            raise SystemExit(f"--resident-alloc mass splits by attention scores; {scoreless} have none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", default="0.25,0.5,0.75", help="fractions of the prompt kept")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), help="a subset of: " + "  ".join(POLICIES))
    parser.add_argument("--max-new", type=int, default=32, help="cap on new tokens (RULER budget if lower)")
    parser.add_argument("--out", default=None, help="directory for scores.jsonl (one line per sample)")
    parser.add_argument("--report", nargs="+", default=None, help="print tables and plot from saved runs")
    parser.add_argument(
        "--recall",
        type=float,
        default=None,
        help="also run every policy recall-gated at this tau (resident set + recall)",
    )
    parser.add_argument(
        "--summary",
        choices=SUMMARIES,
        default="int8",
        help="page summary of the recall-gated variant (docs/eviction.md)",
    )
    parser.add_argument(
        "--recall-policies", nargs="+", default=None, help="recall-gated variants of these only (default: --policies)"
    )
    parser.add_argument(
        "--recall-mode",
        choices=RECALLS,
        default="persistent",
        help="recalled pages stay on the device within --device-budget, are paged in per read (transient), or are "
        "swapped into the resident set after each read (swap)",
    )
    parser.add_argument("--device-budget", type=float, default=1.0, help="device budget of the recall-gated cache")
    parser.add_argument(
        "--resident-alloc",
        choices=RESIDENT_ALLOCS,
        default="uniform",
        help="split of the recall-gated variant's resident tokens across layers (mass: by the policy's prefill "
        "scores, the same total)",
    )
    parser.add_argument("--keys", default="none", help="key codec of the recall-gated variant's resident tokens")
    parser.add_argument("--values", default="none", help="value codec of the recall-gated variant's resident tokens")
    parser.add_argument(
        "--reselect", type=int, default=None, help="re-select the recall-gated variant's resident set every N steps"
    )
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    names = args.policies
    check_args(args)
    wanted = set(names) | set(args.recall_policies or [])
    # what the policies' prefill scores read of the prefill attention (RMM with the realised κ: every row; belady
    # none: it scores the answer trace, built after the reference decode), and always the newest row (the serving
    # reading of what the compression drops)
    scored = [POLICIES[n](torch.empty(0)) for n in wanted if not n.startswith("belady")]
    reads = reduce(PrefillReads.__or__, (ingest_reads(p) for p in scored), PrefillReads(1))
    torch.manual_seed(0)
    model, tok = load("smollm2-135m")
    model.eval()
    per_task = [
        [(task, s) for s in load_task(task, args.context, args.samples, args.seed, converted_dir("smollm2-135m"))]
        for task in args.tasks.split(",")
    ]
    # round robin over the tasks: a run stopped early still covers every task
    samples: list[tuple[str, Sample]] = [row[i] for i in range(args.samples) for row in per_task if i < len(row)]
    keeps = [float(k) for k in args.keep.split(",")]
    configs = [(name, k) for name in names for k in keeps]
    if args.recall is not None:
        tag = f"recall({args.recall:g},{args.summary}"
        tag += "" if args.recall_mode == "persistent" else f",{args.recall_mode}"
        tag += "" if (args.keys, args.values) == ("none", "none") else f",{args.keys}/{args.values}"
        tag += "" if args.device_budget == 1.0 else f",budget={args.device_budget:g}"
        tag += "" if args.reselect is None else f",reselect={args.reselect}"
        tag += "" if args.resident_alloc == "uniform" else f",alloc={args.resident_alloc}"
        configs += [(f"{tag}):{name}", k) for name in args.recall_policies or names for k in keeps]
    log = None
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        log = open(Path(args.out) / "scores.jsonl", "a")
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for i, (task, sample) in enumerate(tqdm(samples, desc="samples")):
        ids = prompt_ids(tok, sample)
        max_new = min(sample.max_new_tokens, args.max_new)
        past, attentions, logits = shared_prefill(model, ids, reads)
        first = logits[:, -1:].argmax(-1)
        kappa = torch.ones(1, ids.shape[1], dtype=torch.float64)
        kappa[:, :-1] = token_probability(logits[:, :-1], ids[:, 1:])  # realised κ of the prompt
        del logits
        got: dict[str, float] = {}
        cost: dict[str, dict[str, int]] = {}
        answer = torch.empty(0)
        for name, keep in [("reference", 1.0), *configs]:
            base = name.split(":", 1)[-1]
            uncertified = ValidationConfig(certify=False)
            if name == "reference":
                cache = CertifiedCache(model, keys="none", values="none", validation=uncertified)
            elif name.startswith("recall("):
                cache = CertifiedCache(
                    model,
                    gate=Gate.certified(args.recall),
                    storage=StorageConfig(keys=args.keys, values=args.values, device_budget=args.device_budget),
                    eviction=EvictionConfig.resident_set(
                        keep,
                        select=POLICIES[base](answer),
                        summary=args.summary,
                        recall=args.recall_mode,
                        reselect=args.reselect,
                        resident_alloc=args.resident_alloc,
                    ),
                )
            else:
                prefill = EvictionConfig.prefill(POLICIES[base](answer), 1.0 - keep)
                cache = CertifiedCache(model, keys="none", values="none", validation=uncertified, eviction=prefill)
            if name != "reference":
                cache.set_prefill_kappa(kappa)
            cache.ingest(past, attentions=attentions if name != "reference" else None)
            toks = decode(model, cache, first, max_new, tok.eos_token_id)
            if name.startswith("recall("):
                tel = cache.telemetry()
                host = cache.layers[0].store.k.host.dtype.itemsize  # page-in bytes are in the host tier's dtype
                cost[f"{name}@{keep:.2f}"] = {
                    "recalled": tel.bytes_recalled * 2 // host,  # at fp16 (2 bytes per entry)
                    "recalled_keys": tel.bytes_recalled_keys * 2 // host,  # key-first recall: keys and values apart
                    "recalled_values": tel.bytes_recalled_values * 2 // host,
                    "paged": tel.bytes_paged * 2 // host,  # recall + exact resident reads + dense fallback
                    # the two parts of "paged" that are not recall: resident entries read exact, dense fallback
                    "exact": sum(r.bytes_exact for r in cache.resident_records) * 2 // host,
                    "dense": sum(r.bytes_dense for r in cache.resident_records) * 2 // host,
                    "steps": toks.shape[1],
                    "fp16": tel.bytes_fp16_context,
                    "device": tel.bytes_device,
                    "held": tel.bytes_held,
                }
                if tel.reselect is not None:
                    cost[f"{name}@{keep:.2f}"].update(
                        reselect_paged=tel.reselect.bytes_paged * 2 // host, promoted=tel.reselect.promoted
                    )
            cache.detach()
            got[f"{name}@{keep:.2f}"] = score(sample, tok.decode(toks[0], skip_special_tokens=True))
            if name == "reference" and any(n.startswith("belady") for n in names):
                answer = answer_trace(model, past, toks)
        row = {
            "task": task,
            "index": i,
            "context": args.context,
            "seed": args.seed,
            "tokens": ids.shape[1],
            "scores": got,
            "recall": cost,
        }
        rows.append(row)
        if log is not None:
            log.write(json.dumps(row) + "\n")
            log.flush()
    print(f"{len(rows)} samples in {(time.perf_counter() - t0) / 60:.1f} min")
    print("\n".join(table(args.context, rows, configs) + recall_cost(rows)))


if __name__ == "__main__":
    main()
