"""Question: what does certifying every attention read cost per decoded token?

SmolLM2-135M by default (``--model``: any zoo name, real weights, offline), one prompt of ``--context`` tokens,
``--steps`` greedy decode steps, measured side by side in one run (same prompt, same shared exact prefill; within a
repetition the variants take turns one decode step at a time, in an order that rotates every step; one warm-up
repetition first):

* ``dense``           transformers ``DynamicCache``
* ``hf-quantized``    transformers ``QuantizedCache`` (fp8 backend: the one that installs here)
* ``kvcert-raw``      kvcert storage (int8 K + int4 V), certificates off (``certify=False``)
* ``kvcert-certified``  the same, every (layer, head, step) cell certified, gate off
* ``kvcert-gated``    the same, ``Gate.certified(0.2)``
* ``capacity-gated``  the capacity scheme of ``--capacity-scheme`` (default dither-int8 K + int4 V; issue 16), gated as
                      ``benchmarks/capacity_ruler.py`` gates it: ``Gate.certified(0.2)`` on 64-token blocks written
                      back exact (persistent), under the library's default device budget; further comma-separated
                      schemes run beside it the same way as ``capacity-gated (<scheme>)``; with ``--box`` the first
                      also as ``capacity-gated (tau=0.2, block, box)``, under the same gate certified again with the
                      box supremum (``docs/math.md#box-supremum``) before it repairs, and ``kvcert-gated`` also as
                      ``kvcert-gated (tau=0.2, box)``; with ``--tier-b`` the first (a dithered one) also as
                      ``capacity-gated (tau=0.2, block, box, tier-b)``, under the box gate that also serves heads on
                      the partially certified box over the Tier-B radii (``docs/read-path.md#tier-b-gate``); with
                      ``--token-tiers K/V:F`` the first also as ``capacity-gated (tau=0.2, token tiers, ...)``, under
                      that Tier-B gate on single-token blocks upgraded into ``K/V``
                      (``docs/read-path.md#upgrade-repair``) with the share ``F`` of the prompt stored in ``K/V`` from
                      the prefill (``docs/read-path.md#token-tiers``), the configuration of
                      ``docs/results.md#token-tiers-served`` (``--tiers-bands N``: its witness bands, as in
                      ``docs/results.md#fold-and-bands``)
* ``resident-3x``     issue 16's 3x configuration as ``docs/results.md#three-x-at-ruler-scale`` runs it: fp16 keys and
                      int4 values for a SnapKV resident set of 20 % of the tokens (chosen from the shared prefill's
                      attention), the omitted pages summarised as ``basis16-qspec`` (page spectra in the
                      query-aware basis, ``docs/math.md#query-aware-basis``) and, beside it, as ``basis8-qspec`` and
                      ``basis8-spec`` (the keys' principal basis); swap recall, ``Gate.certified(0.2)`` at head
                      granularity, device budget 1/3 of the fp16 K/V (``--no-resident`` leaves these out)
* ``allocated-gated`` with ``--allocation FILE`` (a ``kvcert allocate`` file): its per-(layer, KV head) key and value
                      codecs, ``Gate.certified(0.2)`` at head granularity (transient repair), the configuration of the
                      allocated Gemma-3 runs in ``docs/results.md#certificate-driven-bit-allocation-on-smollm2``

Prints ms/token (best of ``--reps``) and the ratios the issues target: certified / raw (<= 1.10), gated / dense
(<= 1.5), capacity-gated / dense, resident-3x / dense and allocated-gated / dense (<= 1.3), from the best times and
as the median of the per-repetition ratios. The prefill records what the resident set's policy reads of its
attention (SnapKV: the newest 32 query rows); every variant starts from that one exact prefill.
Run: ``.venv/bin/python benchmarks/decode_overhead.py [--clock cpu]`` (``cpu``: CPU time of the process with
single-threaded torch, robust to other load on a shared machine; ``wall``: elapsed time with torch's threads).
After the prefill the start-up objects are frozen out of Python's garbage collector (``gc.freeze()``, as
serving engines do once a model is loaded); ``--no-gc-freeze`` measures without: then a full collection that
the certified variants' telemetry records trigger rescans every object of the model and libraries (~400k).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from tqdm import tqdm
from transformers import DynamicCache, QuantizedCache

from kvcert import CertifiedCache, Gate, ValidationConfig
from kvcert.attention.evict_driver import default_select
from kvcert.cli.common import CERTIFIED_TAU, REPAIR_BLOCK, SchemeSpec, parse_schemes
from kvcert.eval.branching import Scheme, exact_prefill
from kvcert.eval.corpora import load_corpus
from kvcert.evict import PrefillReads
from kvcert.models import load
from kvcert.quant import Allocation
from kvcert.report.tables import ReportTable, print_table


def _decode_interleaved(model, first_tok, caches: dict, steps: int, clock, own_attention: str) -> dict[str, float]:
    """Decode ``steps`` greedy tokens with every cache, one step of each variant in turn (the order rotates
    every step), and return each variant's ms/token: every variant sees the same slow and fast spells of a
    shared machine, so their ratios are paired at the granularity of one decode step. Before its step (not
    timed) a kvcert cache is made the model's active one, and other caches get the model's own attention."""
    names = list(caches)
    toks = dict.fromkeys(names, first_tok)
    spent = dict.fromkeys(names, 0.0)
    with torch.no_grad():
        for step in range(steps):
            k = step % len(names)
            for name in names[k:] + names[:k]:
                cache = caches[name]
                if isinstance(cache, CertifiedCache):
                    cache.attach()
                else:
                    model.set_attn_implementation(own_attention)
                t0 = clock()
                out = model(toks[name], cache=cache, use_cache=True)
                toks[name] = out.logits[:, -1:].argmax(-1)
                spent[name] += clock() - t0
    return {name: t / steps * 1e3 for name, t in spent.items()}


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time, torch's default threads; cpu: CPU time of this process (every thread, "
        "BLAS helpers included) with single-threaded torch (what other processes on a shared "
        "machine do not inflate)",
    )
    ap.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the objects of start-up (model, libraries) in Python's collected generations; by "
        "default they are frozen after the prefill, as servers do after loading a model, so a "
        "full collection does not rescan them",
    )
    ap.add_argument(
        "--capacity-scheme",
        default="dither-int8/int4",
        help="keycodec/valuecodec of the capacity-gated variant (as in benchmarks/capacity_ruler.py --schemes); "
        "more, comma-separated, are timed beside it as 'capacity-gated (<scheme>)'",
    )
    ap.add_argument("--plot", metavar="PNG", help="also write the per-repetition times and ratios as a figure")
    ap.add_argument("--model", default="smollm2-135m", help="zoo name of the model (offline weights)")
    ap.add_argument(
        "--allocation", type=Path, default=None, help="also time this kvcert-allocate file as 'allocated-gated'"
    )
    ap.add_argument("--no-resident", dest="resident", action="store_false", help="leave out the resident-3x variants")
    ap.add_argument(
        "--box",
        action="store_true",
        help=f"also time the first capacity scheme under the box-refined block gate as '{CAPACITY_BOX}' and the "
        f"kvcert storage under the box-refined head gate as '{GATED_BOX}'",
    )
    ap.add_argument(
        "--tier-b",
        action="store_true",
        help=f"also time the first capacity scheme (dithered keys) under the Tier-B box gate as '{CAPACITY_TIER_B}'",
    )
    ap.add_argument(
        "--token-tiers",
        metavar="KEYCODEC/VALUECODEC:SHARE",
        default=None,
        help=f"also time the first capacity scheme (dithered keys) as '{CAPACITY_TIERS}': token tiers in these upgrade "
        "codecs with this heavy share, the Tier-B gate on single-token blocks upgrading failing reads",
    )
    ap.add_argument(
        "--tiers-bands",
        type=int,
        default=8,
        help="the key-witness bands of the --token-tiers variant (StorageConfig(bands=); default 8)",
    )
    args = ap.parse_args()
    if args.tiers_bands < 1:
        ap.error(f"--tiers-bands must be >= 1, got {args.tiers_bands}")
    if args.token_tiers is not None:
        codecs, _, share = args.token_tiers.partition(":")
        if len(codecs.split("/")) != 2 or not share:
            ap.error(f"--token-tiers takes KEYCODEC/VALUECODEC:SHARE, got {args.token_tiers!r}")
        args.token_tiers = (tuple(codecs.split("/")), float(share))
    return args


def main() -> None:
    args = _args()
    capacity_schemes = parse_schemes(args.capacity_scheme)
    capacity, *more_capacity = capacity_schemes
    allocation = None if args.allocation is None else Allocation.load(args.allocation)
    resident_3x = RESIDENT_3X if args.resident else {}
    clock = time.perf_counter
    if args.clock == "cpu":
        torch.set_num_threads(1)
        clock = time.process_time
    torch.manual_seed(0)
    model, tok = load(args.model)
    ids = tok(load_corpus("pg-essays")[: args.context * 8], return_tensors="pt").input_ids[:, : args.context]
    reads = PrefillReads()
    if resident_3x or args.token_tiers is not None:  # all read the same (SnapKV): its newest 32 query rows
        reads = default_select().prefill_reads
    prefill = exact_prefill(model, ids, reads)
    pre, first = prefill.cache, prefill.first
    if not args.no_gc_freeze:
        gc.collect()
        gc.freeze()

    def copy_prefill() -> DynamicCache:
        c = DynamicCache(config=model.config)
        for i, layer in enumerate(pre.layers):
            c.update(layer.keys.clone(), layer.values.clone(), i)
        return c

    def kv(certify: bool, gate: Gate | None, keys: str = "int8", values: str = "int4") -> CertifiedCache:
        c = CertifiedCache(model, keys=keys, values=values, gate=gate, validation=ValidationConfig(certify=certify))
        c.ingest(pre)
        return c

    def scheme_cache(scheme: Scheme) -> CertifiedCache:
        c = scheme.cache(model)
        c.ingest(pre, prefill.attentions if scheme.prefill_reads.anything else None)
        return c

    def hfq() -> QuantizedCache:
        c = QuantizedCache(backend="fp8", config=model.config)
        for i, layer in enumerate(pre.layers):
            c.update(layer.keys.clone(), layer.values.clone(), i)
        return c

    variants = {
        "dense": copy_prefill,
        "hf-quantized (fp8)": hfq,
        "kvcert-raw": lambda: kv(False, None),
        "kvcert-certified": lambda: kv(True, Gate.off()),
        "kvcert-gated (tau=0.2)": lambda: kv(True, Gate.certified(0.2)),
        CAPACITY: lambda: kv(True, CAPACITY_GATE, capacity.keys, capacity.values),
        **(
            {
                GATED_BOX: lambda: kv(True, Gate.certified(CERTIFIED_TAU, box=True)),
                CAPACITY_BOX: lambda: kv(True, CAPACITY_BOX_GATE, capacity.keys, capacity.values),
            }
            if args.box
            else {}
        ),
        **(
            {CAPACITY_TIER_B: lambda: kv(True, CAPACITY_TIER_B_GATE, capacity.keys, capacity.values)}
            if args.tier_b
            else {}
        ),
        **{_capacity_name(s): functools.partial(kv, True, CAPACITY_GATE, s.keys, s.values) for s in more_capacity},
        **{name: functools.partial(scheme_cache, scheme) for name, scheme in resident_3x.items()},
    }
    if args.token_tiers is not None:
        upgrade, share = args.token_tiers
        tiers = Scheme(
            CAPACITY_TIERS,
            capacity.keys,
            capacity.values,
            TIERS_GATE,
            upgrade=upgrade,
            heavy_share=share,
            bands=args.tiers_bands,
        )
        variants[CAPACITY_TIERS] = functools.partial(scheme_cache, tiers)
    if not _builds(hfq):  # transformers refuses models with sliding-window layers (Gemma-3); said so
        del variants["hf-quantized (fp8)"]
    if allocation is not None:
        variants[ALLOCATED] = functools.partial(scheme_cache, _allocated(allocation))
    _report(*_measure(model, first, variants, args, clock), args, capacity_schemes)


def _builds(make) -> bool:
    """Whether ``make()`` builds its cache; prints why not (a ``ValueError``) and returns False otherwise."""
    try:
        make()
    except ValueError as err:
        Console().print(f"left out: {err}")
        return False
    return True


def _measure(
    model, first, variants: dict, args: argparse.Namespace, clock
) -> tuple[dict[str, list[float]], dict[str, tuple[float, float]]]:
    """ms/token of every variant per counted repetition (fresh caches each repetition; the first warms up), and per
    kvcert variant the ``(capacity, page-in / fp16 K/V)`` its cache measured over the last repetition."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    measured: dict[str, tuple[float, float]] = {}
    own_attention = model.config._attn_implementation
    for rep in tqdm(range(args.reps + 1), desc="repetitions (the first warms up, not counted)"):
        model.set_attn_implementation(own_attention)
        caches = {name: make() for name, make in variants.items()}
        for name, ms in _decode_interleaved(model, first, caches, args.steps, clock, own_attention).items():
            if rep:
                times[name].append(ms)
        for name, cache in caches.items():
            if isinstance(cache, CertifiedCache):
                cache.detach()
                tel = cache.telemetry()
                if cache.certify and tel.certificates.shape[0] != args.steps:
                    raise RuntimeError(f"{name}: not every decode step was certified; the timing is void")
                measured[name] = (tel.capacity, tel.page_in_ratio)
    return times, measured


def _allocated(allocation: Allocation) -> Scheme:
    """The allocated-gated variant: the allocation's codecs under ``Gate.certified(0.2)`` at head granularity."""
    return Scheme(ALLOCATED, keys="dither-mixed", gate=Gate.certified(CERTIFIED_TAU), allocation=allocation)


def _report(
    times: dict[str, list[float]],
    measured: dict[str, tuple[float, float]],
    args: argparse.Namespace,
    capacity: list[SchemeSpec],
) -> None:
    """Print the best-of table (with each kvcert variant's measured capacity and page-in), the target ratios (best-of
    and per repetition), and the optional plot; ``capacity`` the ``--capacity-scheme`` schemes, the first timed as
    ``capacity-gated``."""
    best = {k: min(v) for k, v in times.items()}
    table = ReportTable(
        f"decode cost, {args.model}, context {args.context}, {args.steps} steps, best of {args.reps}, "
        f"{args.clock} clock, {torch.get_num_threads()} torch threads, "
        f"start-up objects {'not ' if args.no_gc_freeze else ''}frozen (empirical)",
        ("variant", "ms/token", "x dense", "capacity (measured)", "page-in / fp16 K/V, request (measured)"),
        tuple(
            (k, f"{v:.1f}", f"{v / best['dense']:.2f}", *((f"{x:.2f}" for x in measured[k]) if k in measured else "––"))
            for k, v in best.items()
        ),
    )
    console = Console()
    print_table(console, table)
    console.print(f"certified / raw = {best['kvcert-certified'] / best['kvcert-raw']:.3f} (empirical; target <= 1.10)")
    console.print(f"gated / dense   = {best['kvcert-gated (tau=0.2)'] / best['dense']:.3f} (empirical; target <= 1.5)")
    console.print(
        f"capacity-gated ({capacity[0].label}) / dense = {best[CAPACITY] / best['dense']:.3f}"
        " (empirical; target <= 1.3)"
    )
    more = [_capacity_name(s) for s in capacity[1:]]  # further --capacity-scheme ones
    named = (GATED_BOX, CAPACITY_BOX, CAPACITY_TIER_B, CAPACITY_TIERS, *more, *RESIDENT_3X, ALLOCATED)
    for name in (n for n in named if n in best):
        console.print(f"{name} / dense = {best[name] / best['dense']:.3f} (empirical; target <= 1.3)")
    # the same ratios per repetition (the variants of a repetition take turns step by step), then their median:
    # less sensitive than best-of to a slow spell on a shared machine hitting one variant only
    ratios = {}
    extra = (
        (GATED_BOX, "dense", 1.5),
        (CAPACITY_BOX, "dense", 1.3),
        (CAPACITY_TIER_B, "dense", 1.3),
        (CAPACITY_TIERS, "dense", 1.3),
        *((n, "dense", 1.3) for n in more),
        (ALLOCATED, "dense", 1.3),
    )
    targets = [t for t in (*TARGETS, *extra) if t[0] in times]
    for num, den, target in targets:
        per = ratios[(num, den)] = [a / b for a, b in zip(times[num], times[den], strict=True)]
        console.print(
            f"{num} / {den} per repetition: {', '.join(f'{r:.3f}' for r in per)}; median "
            f"{statistics.median(per):.3f} (empirical; target <= {target})"
        )
    if args.plot:
        _plot(times, ratios, targets, args.plot, table.title)
        console.print(f"plot: {args.plot}")


CAPACITY = "capacity-gated (tau=0.2, block)"


ALLOCATED = "allocated-gated (tau=0.2, head)"
CAPACITY_GATE = Gate.certified(CERTIFIED_TAU, granularity="block", block_size=REPAIR_BLOCK, persistent=True)
#: ``--box``: the capacity scheme under the same gate certified again with the box supremum before repairing, and the
#: kvcert storage of ``kvcert-gated`` under its head gate, the same way
CAPACITY_BOX = "capacity-gated (tau=0.2, block, box)"
CAPACITY_BOX_GATE = dataclasses.replace(CAPACITY_GATE, box=True)
GATED_BOX = "kvcert-gated (tau=0.2, box)"
#: ``--tier-b``: the capacity scheme under the box gate that also serves heads on the partially certified Tier-B box
CAPACITY_TIER_B = "capacity-gated (tau=0.2, block, box, tier-b)"
CAPACITY_TIER_B_GATE = dataclasses.replace(CAPACITY_BOX_GATE, tier_b=True)
#: ``--token-tiers``: the first capacity scheme as token tiers, its failing reads upgraded token by token
CAPACITY_TIERS = "capacity-gated (tau=0.2, token tiers, block 1, box, tier-b)"
TIERS_GATE = dataclasses.replace(CAPACITY_TIER_B_GATE, block_size=1)


def _capacity_name(spec: SchemeSpec) -> str:
    """The variant name of a further ``--capacity-scheme`` scheme."""
    return f"capacity-gated ({spec.label})"


def _resident_3x(summary: str) -> Scheme:
    """Issue 16's 3x configuration with the omitted pages summarised as ``summary``."""
    return Scheme(
        f"resident-3x ({summary})",
        keys="none",
        values="int4",
        gate=Gate.certified(CERTIFIED_TAU),
        resident=0.2,
        select=default_select,
        summary=summary,
        recall="swap",
        device_budget=1 / 3,
    )


#: the 3x configuration with the rank-16 query-aware page-spectral summary (the one the target is read on), the rank-8
#: one and the principal-basis one
RESIDENT_3X = {s.name: s for s in map(_resident_3x, ("basis16-qspec", "basis8-qspec", "basis8-spec"))}
RESIDENT = next(iter(RESIDENT_3X))
TARGETS = (
    ("kvcert-certified", "kvcert-raw", 1.10),
    ("kvcert-gated (tau=0.2)", "dense", 1.5),
    (CAPACITY, "dense", 1.3),
    (RESIDENT, "dense", 1.3),
)


def _wrap(name: str) -> str:
    """A variant's name over two lines for a tick label (its parenthesis on the second)."""
    return name.replace(" (", "\n(")


def _plot(
    times: dict[str, list[float]],
    ratios: dict[tuple[str, str], list[float]],
    targets: list[tuple[str, str, float]],
    path: str,
    title: str,
) -> None:
    """ms/token per variant (every repetition, median marked) and each target ratio per repetition, one row each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    names = list(times)
    for i, name in enumerate(names):
        left.scatter([i] * len(times[name]), times[name], s=12, color="tab:blue", alpha=0.6)
        left.hlines(statistics.median(times[name]), i - 0.3, i + 0.3, color="black")
    left.set_xticks(range(len(names)), [_wrap(n) for n in names], fontsize=7, rotation=30, ha="right")
    left.set_ylabel("ms / token (each repetition; bar = median)")
    left.set_ylim(bottom=0)
    for j, (num, den, target) in enumerate(targets):  # one row per ratio: long labels read on the y axis
        per = ratios[(num, den)]
        right.scatter(per, [j] * len(per), s=14, color="tab:orange", alpha=0.7)
        right.vlines(target, j - 0.35, j + 0.35, color="tab:red", linestyles="dashed")
        right.vlines(statistics.median(per), j - 0.25, j + 0.25, color="black")
    right.set_yticks(range(len(targets)), [f"{num}\n/ {den} (target ≤ {t})" for num, den, t in targets], fontsize=7)
    right.invert_yaxis()
    right.set_xlabel("ratio per repetition (dashed: target; bar = median)")
    right.axvline(1.0, color="grey", linewidth=0.5)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
