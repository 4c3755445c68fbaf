"""Large adversarial soundness fuzz of every softmax-TV form (>= 10^7 cells per form by default).

Draws cells with the same generator as ``tests/bounds`` (S from 2 to 4096, spiky/flat p̃, radii over six
orders of magnitude, ε at ±radius extremes, interior, and extremal rank-threshold splits), checks
``bound + 1e-12 >= true TV`` in every cell, and reports violations (must be 0) and the worst TV/bound ratio
over informative cells (1e-9 <= bound < 1).

With ``--codec-cells N`` it then runs ``N`` end-to-end cells per key-codec form (``tests/quant/codec_cells.py``:
adversarial keys, the codec, its Tier-A witness, queries up to the Cauchy–Schwarz equality direction) and checks
``radius ≥ |ε_t|`` per token and ``meter + 1e-12 ≥ TV`` per cell (``--cells 0`` runs only those).

With ``--qsw-cells N`` it runs ``N`` end-to-end cells per query-subspace witness form (``make_qsw_cells``: a basis per
cell, orthonormal or not, queries up to the equality direction of the term outside the span;
``docs/math.md#query-subspace-witness``) with the same two checks.

With ``--witness-cells N`` it runs the compact-witness forms (``docs/math.md#compact-witnesses``): ``N`` adversarial
elements through the log8 code (decoded ≥ value per element) and ``N`` end-to-end cells per ``(key codec, log8)``
form whose band norms go through the code before the Tier-A radius (radius ≥ ``|ε_t|``, meter ≥ TV);
``--witness-codecs`` picks the key codecs of those forms.

With ``--tier-b-cells N`` it runs the Tier-B gate's partial box (``docs/math.md#tier-b-in-the-box``,
``tests/quant/tier_b_cells.py``): ``N`` end-to-end cells per dithered key codec, queries drawn before the dither,
``δ_loc`` and ``τ`` drawn per chunk; per cell the partial bound (the box over ``min(c, x)``, ``x`` the uniform-law radii
of ``docs/math.md#tier-b-uniform``) must hold on the Tier-B event (0 violations), and per ``δ_loc`` the event may fail
in at most that share of cells (one-sided binomial tail, p > 10^-6); ``--tier-b-codecs`` picks the codecs. With
``--order-stats`` the same cells also go through the order-statistics box (``docs/math.md#order-statistics-box``): on
both events (the union and the counts) the least of the partial bound and that box must hold (0 violations), and its
event too may fail in at most a ``δ_loc`` share.

The page forms (``kvcert.bounds.pages``: page logit bound, omitted-mass bound, direct form, composed certificate of
a resident read; the same per token for the int8 and the principal-basis key sketches, the latter with an int4
and with a 2-bit tail; ``--page-summaries`` picks which) run on their own
adversarial cells (``tests/bounds/pages_adversarial.py``: corner-aligned queries, needles, masked omitted tokens;
the families ``edge`` / ``masked`` / ``range`` of summaries at their rounding edges, masks inside pages and keys at
the ends of the float16 range), ``--page-cells`` of them (0 skips them); a
second table gives each family's cells and violations. ``--page-seconds S`` stops the page forms after the first
whole round past ``S`` seconds and reports the cells reached (the header says so).

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/soundness_fuzz.py [--cells 10000000] [--seed 0]
[--codec-cells 10000000] [--qsw-cells 10000000] [--witness-cells 10000000] [--tier-b-cells 10000000]
[--order-stats]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "bounds"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "quant"))
from bounds_adversarial import CI_PLAN, SLACK, all_form_bounds, informative_ratio, make_cells  # noqa: E402
from bounds_stats import binomial_sf  # noqa: E402
from codec_cells import (  # noqa: E402
    CODEC_FORMS,
    CODEC_PLAN,
    QSW_FORMS,
    WITNESS_FORMS,
    WITNESS_PLAN,
    CodecCells,
    adversarial_witnesses,
    make_codec_cells,
    make_qsw_cells,
    witness_element_violations,
)
from codec_cells import violations as codec_violations  # noqa: E402
from tier_b_cells import TIER_B_FORMS, TIER_B_PLAN, make_tier_b_cells  # noqa: E402

WITNESS_CODECS = tuple(codec for codec, _ in WITNESS_FORMS)
from pages_adversarial import (  # noqa: E402
    FAMILIES,
    PAGE_PLAN,
    PAGE_SUMMARIES,
    make_page_cells,
    page_checks,
    page_violations,
)


def codec_fuzz(n_cells: int, gen: torch.Generator, forms: dict[str, Callable[[int, int], CodecCells]]) -> bool:
    """End-to-end key-codec forms: ``n_cells`` (whole rounds) per form, each drawn by ``forms[label](rows, S)``;
    prints a table, returns True if clean."""
    per_round = sum(rows for _, rows in CODEC_PLAN)
    rounds = -(-n_cells // per_round)
    print(f"{'codec form':>22} | {'cells':>11} | {'radius viol.':>12} | {'meter viol.':>11} | {'max |eps|/c':>11}")
    clean = True
    for label, draw in forms.items():
        cells, bad_r, bad_m, tight = 0, 0, 0, 0.0
        for _ in tqdm(range(rounds), desc=label):
            for s, rows in CODEC_PLAN:
                batch = draw(rows, s)
                r, m = codec_violations(batch)
                bad_r, bad_m, cells = bad_r + r, bad_m + m, cells + rows
                tight = max(tight, float((batch.eps.abs() / batch.radius.clamp(min=1e-300)).max()))
        print(f"{label:>22} | {cells:>11,} | {bad_r:>12} | {bad_m:>11} | {tight:>11.6f}")
        clean = clean and bad_r == 0 and bad_m == 0
    return clean


def witness_fuzz(n_cells: int, gen: torch.Generator, codecs: tuple[str, ...]) -> bool:
    """Compact-witness forms: ``n_cells`` log8 elements, then ``n_cells`` (whole rounds) end-to-end cells per
    ``WITNESS_FORMS`` entry whose key codec is in ``codecs``; prints a table, returns True if clean."""
    chunk = 1_000_000
    elems, bad, worst = 0, 0, 0.0
    for _ in tqdm(range(-(-n_cells // chunk)), desc="log8 elements"):
        b, w = witness_element_violations(adversarial_witnesses(chunk, gen), gen)
        elems, bad, worst = elems + chunk, bad + b, max(worst, w)
    print(f"{'witness form':>20} | {'cells':>11} | {'violations':>10} | {'worst ratio':>11}")
    print(f"{'log8 element':>20} | {elems:>11,} | {bad:>10} | {worst:>11.6f}  (decoded / value at or above base)")
    clean = bad == 0
    per_round = sum(rows for _, rows in WITNESS_PLAN)
    for codec, witness in (form for form in WITNESS_FORMS if form[0] in codecs):
        cells, bad_r, bad_m, tight = 0, 0, 0, 0.0
        for _ in tqdm(range(-(-n_cells // per_round)), desc=f"{codec}+{witness}"):
            for s, rows in WITNESS_PLAN:
                batch = make_codec_cells(codec, rows, s, gen, witness=witness)
                r, m = codec_violations(batch)
                bad_r, bad_m, cells = bad_r + r, bad_m + m, cells + rows
                tight = max(tight, float((batch.eps.abs() / batch.radius.clamp(min=1e-300)).max()))
        name = f"{codec}+{witness}"
        print(
            f"{name:>20} | {cells:>11,} | {bad_r + bad_m:>10} | {tight:>11.6f}"
            f"  (radius {bad_r}, meter {bad_m}; max |eps|/c)"
        )
        clean = clean and bad_r == 0 and bad_m == 0
    return clean


def tier_b_fuzz(n_cells: int, gen: torch.Generator, codecs: tuple[str, ...], order_stats: bool = False) -> bool:
    """The Tier-B partial box: ``n_cells`` (whole rounds) per dithered key codec in ``codecs``; prints a table (cells,
    violations on the event, off-event cells per ``δ_loc`` with the binomial tail, cells the Tier-B radii tightened,
    cells whose uniform-law radii are below the union radii, off-event cells above the partial bound), returns True if
    clean. ``order_stats``: a second line per codec for the order-statistics box (violations on both events, its
    off-event cells per ``δ_loc``, cells it tightened)."""
    per_round = sum(rows for _, rows in TIER_B_PLAN)
    off = "off event / cells (tail p) per delta_loc"
    print(
        f"{'tier-b form':>12} | {'cells':>11} | {'viol. on event':>14} | {off:>44} | {'tightened':>9}"
        f" | {'uniform < union':>15} | {'above bound off event':>21}"
    )
    clean = True
    for codec in codecs:
        cells, bad, tighter, over, os_bad, os_tighter, shrunk = 0, 0, 0, 0, 0, 0, 0
        failed: dict[float, list[int]] = {}
        os_failed: dict[float, list[int]] = {}
        for _ in tqdm(range(-(-n_cells // per_round)), desc=f"{codec} tier-b"):
            for s, rows in TIER_B_PLAN:
                batch, _ = make_tier_b_cells(codec, rows, s, gen, order_stats=order_stats)
                cells, bad = cells + rows, bad + batch.violations()
                tighter, over = tighter + batch.tightened(), over + batch.above_off_event()
                shrunk += batch.uniform_shrunk()
                seen = failed.setdefault(batch.delta_loc, [0, 0])
                seen[0], seen[1] = seen[0] + rows, seen[1] + batch.off_event()
                if order_stats:
                    os_bad, os_tighter = os_bad + batch.os_violations(), os_tighter + batch.os_tightened()
                    seen = os_failed.setdefault(batch.delta_loc, [0, 0])
                    seen[0], seen[1] = seen[0] + rows, seen[1] + batch.os_off_event()
        for label, fails, viol, tight, less, above in (
            (codec, failed, bad, tighter, f"{shrunk / cells:.3f}", str(over)),
            *([("+order-stat", os_failed, os_bad, os_tighter, "–", "–")] if order_stats else []),
        ):
            tails = {d: binomial_sf(f, n, d) for d, (n, f) in fails.items()}
            per_delta = ", ".join(f"{d:g}: {f}/{n} ({tails[d]:.2g})" for d, (n, f) in sorted(fails.items()))
            print(
                f"{label:>12} | {cells:>11,} | {viol:>14} | {per_delta:>44} | {tight / cells:>9.3f} | {less:>15}"
                f" | {above:>21}"
            )
            clean = clean and viol == 0 and all(p > 1e-6 for p in tails.values())
    return clean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", type=int, default=10_000_000, help="cells per form (whole rounds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--codec-cells", type=int, default=0, help="end-to-end cells per key-codec form (0: skip)")
    ap.add_argument(
        "--qsw-cells", type=int, default=0, help="end-to-end cells per query-subspace witness form (0: skip)"
    )
    ap.add_argument("--witness-cells", type=int, default=0, help="cells per compact-witness form (0: skip)")
    ap.add_argument("--tier-b-cells", type=int, default=0, help="cells per Tier-B partial-box form (0: skip)")
    ap.add_argument(
        "--order-stats", action="store_true", help="also the order-statistics box on the Tier-B cells (--tier-b-cells)"
    )
    ap.add_argument(
        "--tier-b-codecs",
        default=",".join(TIER_B_FORMS),
        help=f"comma-separated dithered key codecs of the Tier-B forms (default all: {','.join(TIER_B_FORMS)})",
    )
    ap.add_argument("--page-cells", type=int, default=10_000_000, help="cells of the page forms (whole rounds)")
    ap.add_argument(
        "--page-seconds", type=float, default=None, help="stop the page forms after the round that passes S seconds"
    )
    ap.add_argument(
        "--page-summaries",
        default=",".join(PAGE_SUMMARIES),
        help=f"comma-separated summaries whose page forms run (default all: {','.join(PAGE_SUMMARIES)})",
    )
    ap.add_argument(
        "--witness-codecs",
        default=",".join(WITNESS_CODECS),
        help=f"comma-separated key codecs whose compact-witness forms run (default all: {','.join(WITNESS_CODECS)})",
    )
    ap.add_argument(
        "--forms",
        choices=("all", "pages", "witness", "tier-b"),
        default="all",
        help="'pages': only the page forms; 'witness': only the compact-witness forms (--witness-cells); 'tier-b': "
        "only the Tier-B partial box (--tier-b-cells)",
    )
    args = ap.parse_args()

    def names(option: str, known: tuple[str, ...]) -> tuple[str, ...]:
        """The comma-separated names of ``--<option>``, each among ``known`` (a usage error otherwise)."""
        given = getattr(args, option.replace("-", "_"))
        picked = tuple(given.split(","))
        if not set(picked) <= set(known):
            ap.error(f"--{option} takes names among {','.join(known)}; got {given!r}")
        return picked

    summaries = names("page-summaries", PAGE_SUMMARIES)
    witness_codecs = names("witness-codecs", WITNESS_CODECS)
    tier_b_codecs = names("tier-b-codecs", TIER_B_FORMS)
    gen = torch.Generator().manual_seed(args.seed)
    per_round = sum(rows for _, rows in CI_PLAN)
    rounds = 0 if args.forms != "all" else -(-args.cells // per_round)
    cells: dict[str, int] = {}
    violations: dict[str, int] = {}
    worst: dict[str, float] = {}
    t0 = time.perf_counter()
    with tqdm(total=rounds * per_round, unit="cell", unit_scale=True, desc="fuzz") as bar:
        for _ in range(rounds):
            for s, rows in CI_PLAN:
                batch = make_cells(rows, s, gen)
                for form, (bound, tv) in all_form_bounds(batch, gen).items():
                    bad = (bound + SLACK < tv) | torch.isnan(bound)
                    cells[form] = cells.get(form, 0) + rows
                    violations[form] = violations.get(form, 0) + int(bad.sum())
                    worst[form] = max(worst.get(form, 0.0), float(informative_ratio(bound, tv).max()))
                bar.update(rows)
    per_page_round = sum(plan[-1] for plan in PAGE_PLAN)
    page_rounds = 0 if args.forms in ("witness", "tier-b") else -(-args.page_cells // per_page_round)
    fam_cells, fam_bad = [0] * len(FAMILIES), [0] * len(FAMILIES)
    t_pages, done = time.perf_counter(), 0
    with tqdm(total=page_rounds * per_page_round, unit="cell", unit_scale=True, desc="pages") as bar:
        for _ in range(page_rounds):
            if args.page_seconds is not None and time.perf_counter() - t_pages > args.page_seconds:
                break
            for s_r, s_o, ps, d, rows in PAGE_PLAN:
                batch = make_page_cells(rows, s_r, s_o, ps, d, gen)
                any_bad = torch.zeros(rows, dtype=torch.bool)
                for form, (bound, truth) in page_checks(batch, summaries=summaries).items():
                    bad = page_violations(form, bound, truth)
                    any_bad |= bad.reshape(rows, -1).any(-1)
                    cells[form] = cells.get(form, 0) + rows
                    violations[form] = violations.get(form, 0) + int(bad.sum())
                    ratio = torch.zeros(1) if form.endswith("_logit") else informative_ratio(bound, truth)
                    worst[form] = max(worst.get(form, 0.0), float(ratio.max()))
                for i in range(len(FAMILIES)):
                    fam_cells[i] += int((batch.family == i).sum())
                    fam_bad[i] += int((any_bad & (batch.family == i)).sum())
                bar.update(rows)
            done += 1
    stopped = f" (stopped by --page-seconds after {done} of {page_rounds} page rounds)" if done < page_rounds else ""
    print(f"seed={args.seed} rounds={rounds} wall={time.perf_counter() - t0:.0f}s slack={SLACK:g}{stopped}")
    print(f"{'form':>12} | {'cells':>11} | {'violations':>10} | {'worst TV/bound':>14}")
    print("-" * 58)
    for form in cells:
        print(f"{form:>12} | {cells[form]:>11,} | {violations[form]:>10} | {worst[form]:>14.6f}")
    if any(fam_cells):
        print(f"{'page family':>12} | {'cells':>11} | {'cells with a violation (any form)':>33}")
        for name, n, bad in zip(FAMILIES, fam_cells, fam_bad, strict=True):
            print(f"{name:>12} | {n:>11,} | {bad:>33}")
    codec_forms: dict[str, Callable[[int, int], CodecCells]] = {
        codec: lambda rows, s, codec=codec: make_codec_cells(codec, rows, s, gen) for codec in CODEC_FORMS
    }
    qsw_forms: dict[str, Callable[[int, int], CodecCells]] = {
        f"{codec}+qsw-int{bits}": lambda rows, s, codec=codec, bits=bits: make_qsw_cells(codec, bits, rows, s, gen)
        for codec, bits in QSW_FORMS
    }
    codecs_clean = codec_fuzz(args.codec_cells, gen, codec_forms) if args.codec_cells else True
    qsw_clean = codec_fuzz(args.qsw_cells, gen, qsw_forms) if args.qsw_cells else True
    witness_clean = witness_fuzz(args.witness_cells, gen, witness_codecs) if args.witness_cells else True
    tier_b_clean = tier_b_fuzz(args.tier_b_cells, gen, tier_b_codecs, args.order_stats) if args.tier_b_cells else True
    if any(violations.values()) or not codecs_clean or not qsw_clean or not witness_clean or not tier_b_clean:
        raise SystemExit("VIOLATIONS FOUND")


if __name__ == "__main__":
    main()
