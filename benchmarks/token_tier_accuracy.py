"""Do token tiers keep dense RULER accuracy at about 3×? (empirical: the reads here are not certified)

`benchmarks/tv_box_tightness.py --heavy` showed that storing the tokens the prefill attends to most in a wider code
(token tiers) lets the exact attention stay within TV 0.2 of dense on 99–100 % of KV-head reads at 3.0–3.5×, while
its capacity column counted 2-bit values on the light tokens whose effect on answers it did not measure. This script
measures the answers: per RULER sample, one exact prefill; then per row a greedy continuation from a copy of that
prefill whose keys and values are replaced by what the tiered codecs serve, beside the dense continuation.

Per row (``--light`` keys, ``--heavy`` keys, a heavy share ``F`` from ``--heavy-fracs`` and a value pair ``LIGHT/HEAVY``
from ``--values``):
- the heavy tokens of each (layer, KV head) are chosen from the prefill alone exactly as in the tightness benchmark
  (``tv_box_tightness.heavy_tokens``: the first 4 tokens, the last 32 prefill positions, and the prefix tokens those
  32 queries attend to most, up to ``F`` of the tokens; a sliding-window layer keeps its window's share of them).
  ``F = 0`` is the row without tiers: every token in the light codes;
- every prompt token's key and value is served as its tier's codec decodes it (dithered codecs draw their dither
  from the sample's seed, layer and positions); the tokens the model generates stay exact, as the cache's pending
  write block keeps them;
- the capacity is the tightness benchmark's nominal figure: fp16 K/V over the measured bytes per token and KV head of
  each tier's packed tensors, the store's log8 witnesses included, mixed by ``F`` (empirical; a sliding-window
  layer holds fewer tokens than a global one, which this per-token figure does not count).

With ``--promote none,k,kv`` each tiered row is run once per mode: ``k`` and ``kv`` serve it through a simulated
token-granular gate (:class:`Promoter`) at τ = 0.2 on ``min(Tier A, Tier B)`` radii (Tier B from the uniform law, as
the Tier-B gate serves it): at every decode step a KV head whose box is above τ promotes the light tokens it needs to
the heavy tier for good, keys (``k``) or keys and values (``kv``) re-encoded by the heavy codecs from the exact
entries (the least count on the ranking of ``tier_repair_pagein.promote_reads``). Such a row also reports the share
of prompt tokens promoted, the capacity with them at the heavy codecs' bytes, and the page-in (each promoted token's
fp16 key, and value, once).

Reported per row: accuracy, the paired bootstrap 95 % CI of (row − dense) and the exact McNemar p over the same
samples, how many continuations are token-identical to dense, and the capacity; all empirical. ``--plot`` draws
accuracy (with dense + CI whiskers) against capacity; ``--out`` writes ``results.json`` (every number with its tier).

Usage: ``OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/token_tier_accuracy.py [--model gemma3-270m]
[--tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2] [--context 2048] [--samples 4]
[--seed 5] [--light dither-int5+bypass8] [--heavy dither-int8+bypass8] [--heavy-fracs 0,0.2] [--values int2/int4]
[--promote none,kv] [--max-new-tokens 32] [--plot FILE] [--out DIR]``; ``--report-only --out DIR [--plot FILE]``
prints the table and draws the figure again from ``DIR/results.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcert import ValidationConfig  # noqa: E402
from kvcert.bounds import band_norms  # noqa: E402
from kvcert.cli.common import load_model  # noqa: E402
from kvcert.cli.progress import progress_bar  # noqa: E402
from kvcert.eval import ruler  # noqa: E402
from kvcert.eval.branching import copy_cache, exact_prefill, greedy_from  # noqa: E402
from kvcert.eval.harness import prompt_ids  # noqa: E402
from kvcert.eval.stats import mcnemar, paired_bootstrap  # noqa: E402
from kvcert.integrations.attention_impl import swapped_attention  # noqa: E402
from kvcert.models.zoo import converted_dir  # noqa: E402
from kvcert.quant import bytes_per_token_head, get, sample_key  # noqa: E402
from kvcert.report.tables import ReportTable, fmt, print_table, to_markdown  # noqa: E402
from tier_repair_pagein import promote_reads, token_radius  # noqa: E402
from tv_box_tightness import BANDS, TAU, Tiers, heavy_tokens, key_bytes  # noqa: E402
from witness_tightness import Captured, capture  # noqa: E402

EMPIRICAL = "empirical"


@dataclass(frozen=True)
class Row:
    """One configuration: light and heavy key codecs, the heavy share, and the (light, heavy) value codecs."""

    light: str
    heavy: str
    frac: float
    values: tuple[str, str]
    promote: str = ""  # "": none; "k": a failing read promotes keys; "kv": keys and values (:class:`Promoter`)

    @property
    def tiers(self) -> Tiers | None:
        return Tiers(self.heavy, self.frac) if self.frac > 0 else None

    @property
    def label(self) -> str:
        keys = self.light if self.frac == 0 else f"{self.light} + {self.frac:.0%} {self.heavy}"
        vals = self.values[0] if self.frac == 0 else "/".join(self.values)
        return f"{keys} | V {vals}" + (f" | promote {self.promote.upper()}" if self.promote else "")

    def extra_bytes(self, head_dim: int) -> float:
        """Bytes per (token, KV head) a promotion adds: the heavy codecs' less the light ones', keys and (``kv``)
        values (measured from each codec's packed tensors)."""
        keys = bytes_per_token_head(get(self.heavy), head_dim) - bytes_per_token_head(get(self.light), head_dim)
        if self.promote != "kv":
            return keys
        light_v, heavy_v = (bytes_per_token_head(get(v), head_dim) for v in self.values)
        return keys + heavy_v - light_v

    def kv_bytes(self, head_dim: int) -> float:
        """The row's nominal K/V bytes per token and KV head (measured per tier, mixed by the share)."""
        light_v, heavy_v = (bytes_per_token_head(get(v), head_dim) for v in self.values)
        return key_bytes(self.light, self.tiers, head_dim) + (1 - self.frac) * light_v + self.frac * heavy_v

    def capacity(self, head_dim: int) -> float:
        """fp16 K/V bytes over :meth:`kv_bytes`."""
        return 4 * head_dim / self.kv_bytes(head_dim)


def heavy_masks(seen: Captured, tiers: Tiers | None) -> list[torch.Tensor]:
    """Per layer, ``[Hkv, S]`` bool: the heavy tokens of each KV head over the prompt's ``S`` positions."""
    out = []
    for q, k, window in zip(seen.qs, seen.ks, seen.windows, strict=True):
        hkv, s = k.shape[:2]
        if tiers is None:
            out.append(torch.zeros(hkv, s, dtype=torch.bool))
            continue
        group = q.shape[0] // hkv
        out.append(
            torch.stack(
                [heavy_tokens(q[h * group : (h + 1) * group], k[h], seen.scale, window, 0, tiers) for h in range(hkv)]
            )
        )
    return out


def tier_codes(x: torch.Tensor, name: str, seed: int, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x[1, Hkv, n, D]`` (the layer's last ``n`` prompt positions) as codec ``name`` serves it, and its Tier-B steps
    ``[Hkv, n, G]`` (float64; ``None`` for a codec without Tier B). Encoded with the codec's own per-token scales over
    the whole layer, so a token's code does not depend on its tier's other tokens."""
    codec = get(name)
    if codec.block != 1 or codec.residual_window:
        raise ValueError(f"token tiers need per-token codecs; {name!r} encodes blocks of tokens")
    x32 = x.to(torch.float32)
    key = sample_key(x32, seed, layer) if codec.needs_key else None
    packed, out = codec.encode_decode(x32, key)
    steps = codec.steps(packed) if codec.tier_b else None
    return out.to(x.dtype), None if steps is None else steps[0].to(torch.float64)


def served(
    x: torch.Tensor, heavy: torch.Tensor, light_codec: str, heavy_codec: str, seed: int, layer: int
) -> torch.Tensor:
    """``x[1, Hkv, n, D]`` as the tiers serve it: heavy tokens (``heavy[Hkv, n]``) through ``heavy_codec``, the rest
    through ``light_codec`` (:func:`tier_codes`)."""
    light = tier_codes(x, light_codec, seed, layer)[0]
    if not bool(heavy.any()):
        return light
    return torch.where(heavy[None, :, :, None], tier_codes(x, heavy_codec, seed, layer)[0], light)


@dataclass
class LayerTiers:
    """One layer's prompt positions as a promoting row holds them: per tier (light, heavy) the served keys and values
    ``[Hkv, P, D]``, the key residuals' band norms ``[Hkv, P, B]``, the Tier-B steps (float64) and group size; the
    exact keys and values; and which tokens are heavy now (``tier[Hkv, P]``, grown by promotions)."""

    keys: tuple[torch.Tensor, torch.Tensor]
    values: tuple[torch.Tensor, torch.Tensor]
    bands: tuple[torch.Tensor, torch.Tensor]
    steps: tuple[torch.Tensor | None, torch.Tensor | None]
    groups: tuple[int, int]
    exact: tuple[torch.Tensor, torch.Tensor]
    tier: torch.Tensor


@dataclass
class Promoter:
    """A token-granular gate at ``tau`` (0.2) over the tiered prompt K/V whose repair is promotion, simulated here from
    the radii a cache would hold (the reads are not certified by a cache). At each decode step and KV head: the box over
    ``min(Tier A, Tier B)`` radii of the current tiers (Tier B from the uniform law at ``delta_loc``, as the Tier-B
    gate serves it); a read above τ moves the light tokens it needs to the heavy tier for good
    (:func:`tier_repair_pagein.promote_reads`), their keys (with ``mode == "kv"`` their values too) replaced in the
    cache by the heavy codecs' codes of the exact entries. A read that fails even fully promoted is served exact (a
    transient page-in) and counted. Generated tokens are exact, radius 0."""

    layers: dict[int, LayerTiers]
    mode: str
    delta_loc: float
    tau: float = TAU
    promoted: int = 0
    reads: int = 0
    failed: int = 0
    steps: dict[int, int] = field(default_factory=dict)

    def attend(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):  # noqa: ANN001, ANN003, ANN201
        """The attention function of a decode step: promote, then sdpa over the cache's (updated) keys and values."""
        st = self.layers[module.layer_idx]
        j = self.steps[module.layer_idx] = self.steps.get(module.layer_idx, 0) + 1  # this layer's decode step
        hkv, p = st.tier.shape
        g, n = query.shape[1] // hkv, key.shape[2]
        inside = n - j  # prompt slots still in the cache (a sliding layer drops its oldest)
        a = p - inside  # the first of them among the stored prompt positions
        vis = torch.ones(n, dtype=torch.bool)
        if attention_mask is not None:
            last = attention_mask[0, 0, -1]
            vis = last if last.dtype == torch.bool else last == 0
        sc = float(scaling)
        read_k, read_v = key, value
        for h in range(hkv):
            q = query[0, h * g : (h + 1) * g, -1:].to(torch.float64)  # [G, 1, D]
            gen = key[0, h, inside:].to(torch.float64)
            logits, radii = [], []
            for t in (0, 1):
                logits.append(sc * q @ torch.cat([st.keys[t][h, a:].to(torch.float64), gen]).T)
                steps = st.steps[t]
                c = token_radius(
                    q,
                    st.bands[t][h, a:],
                    None if steps is None else steps[h, a:],
                    st.groups[t],
                    sc,
                    n,
                    self.delta_loc,
                    True,
                )
                radii.append(torch.nn.functional.pad(c, (0, n - inside)))
            start = torch.cat([st.tier[h, a:], torch.ones(n - inside, dtype=torch.bool)])
            tier, _, failed = promote_reads(
                (logits[0], logits[1]), (radii[0], radii[1]), vis.expand(g, 1, n), start, self.tau
            )
            new = tier[:inside] & ~st.tier[h, a:]
            self.reads += 1
            if bool(new.any()):
                st.tier[h, a:] |= new
                self.promoted += int(new.sum())
                key[0, h, :inside][new] = st.keys[1][h, a:][new]  # the cache's own tensor: kept for later steps
                if self.mode == "kv":
                    value[0, h, :inside][new] = st.values[1][h, a:][new]
            if bool(failed.any()):
                self.failed += 1
                if read_k is key:
                    read_k, read_v = key.clone(), value.clone()
                read_k[0, h, :inside] = st.exact[0][h, a:]
                read_v[0, h, :inside] = st.exact[1][h, a:]
        return sdpa_attention_forward(
            module, query, read_k, read_v, attention_mask, dropout=dropout, scaling=scaling, **kw
        )

    def share(self) -> float:
        """Promoted tokens over the prompt tokens the layers hold (every layer and KV head)."""
        return self.promoted / sum(st.tier.numel() for st in self.layers.values())


def tiered_cache(model, prefill_cache, masks: list[torch.Tensor], row: Row, seed: int, delta_loc: float = 0.0):  # noqa: ANN001, ANN201
    """A copy of the exact prefill whose prompt keys and values are what ``row``'s tiers serve, and for a promoting
    row its :class:`Promoter` at ``delta_loc`` (``None`` otherwise)."""
    layers: dict[int, LayerTiers] = {}

    def transform(i: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heavy = masks[i][:, -keys.shape[2] :]  # a sliding-window layer holds only its last positions
        if not row.promote:
            return (
                served(keys, heavy, row.light, row.heavy, seed, i),
                served(values, heavy, row.values[0], row.values[1], seed, i),
            )
        kt = [tier_codes(keys, c, seed, i) for c in (row.light, row.heavy)]
        vt = [tier_codes(values, c, seed, i)[0] for c in row.values]
        exact = keys[0].to(torch.float64)
        bands = [band_norms(x[0][0].to(torch.float64) - exact, BANDS) for x in kt]
        groups = [int(getattr(get(c), "group_size", 0)) for c in (row.light, row.heavy)]
        layers[i] = LayerTiers(
            (kt[0][0][0], kt[1][0][0]),
            (vt[0][0], vt[1][0]),
            (bands[0], bands[1]),
            (kt[0][1], kt[1][1]),
            (groups[0], groups[1]),
            (keys[0].clone(), values[0].clone()),
            heavy.clone(),
        )
        on = heavy[None, :, :, None]
        return torch.where(on, kt[1][0], kt[0][0]), torch.where(on, vt[1], vt[0])

    cache = copy_cache(model, prefill_cache, transform)
    return cache, (Promoter(layers, row.promote, delta_loc) if row.promote else None)


def parse_rows(args: argparse.Namespace) -> list[Row]:
    fracs = [float(f) for f in args.heavy_fracs.split(",")]
    if any(not 0 <= f < 1 for f in fracs):
        raise SystemExit(f"--heavy-fracs: each share must be in [0, 1), got {args.heavy_fracs!r}")
    pairs = []
    for pair in args.values.split(","):
        light, sep, heavy = pair.partition("/")
        if not sep or not light or not heavy:
            raise SystemExit(f"--values: expected LIGHT/HEAVY pairs, got {pair!r}")
        pairs.append((light, heavy))
    for name in {args.light, args.heavy, *(c for p in pairs for c in p)}:
        get(name)  # an unknown codec is refused by name before the model loads
    modes = [m.strip() for m in args.promote.split(",")] if args.promote else [""]
    if any(m not in ("", "none", "k", "kv") for m in modes):
        raise SystemExit(f"--promote: each mode must be none, k or kv, got {args.promote!r}")
    modes = ["" if m == "none" else m for m in modes]
    rows = {
        Row(args.light, args.heavy, f, p if f > 0 else (p[0], p[0]), m if f > 0 else "")
        for f in fracs
        for p in pairs
        for m in modes
    }
    return sorted(rows, key=lambda r: (r.frac, r.values, r.promote))


@dataclass
class Measured:
    """What a run measured, for the table, the figure and ``results.json``: per row (and ``"dense"``) the per-sample
    scores, per row the continuations token-identical to dense, the head dimension its capacity needs, the texts."""

    rows: list[Row]
    head_dim: int
    scores: dict[str, list[float]]
    same: dict[str, int]
    texts: list[dict[str, str]] = field(default_factory=list)
    promoted: dict[str, list[float]] = field(default_factory=dict)  # per promoting row and sample: the share
    failed: dict[str, list[float]] = field(default_factory=dict)  # ... the share of reads no promotion passed

    def capacity(self, row: Row) -> float:
        """The row's capacity: nominal, less what its promotions added (mean promoted share over the samples)."""
        share = self.promoted.get(row.label)
        extra = sum(share) / len(share) * row.extra_bytes(self.head_dim) if share else 0.0
        return 4 * self.head_dim / (row.kv_bytes(self.head_dim) + extra)

    def accuracy(self, label: str) -> float:
        """Mean score of ``label`` (a row's label or ``"dense"``) over the samples."""
        return sum(self.scores[label]) / len(self.scores[label])


def table(m: Measured, model: str) -> ReportTable:
    dense = m.scores["dense"]
    out = [("dense", str(len(dense)), fmt(m.accuracy("dense"), percent=True), "–", "–", "–", "1", "–", "–", "–")]
    for row in m.rows:
        got = m.scores[row.label]
        ci = paired_bootstrap(dense, got)
        exact = [float(s == 1.0) for s in got]
        p = mcnemar([float(s == 1.0) for s in dense], exact).p_exact
        out.append(
            (
                row.label,
                str(len(got)),
                fmt(m.accuracy(row.label), percent=True),
                f"{100 * ci.diff:+.1f} [{100 * ci.low:+.1f}, {100 * ci.high:+.1f}]",
                fmt(p),
                f"{m.same[row.label]} / {len(got)}",
                f"{row.capacity(m.head_dim):.2f}×",
                *promotion_cells(m, row),
            )
        )
    return ReportTable(
        f"Token tiers on {model}: RULER accuracy of the served prompt K/V against dense (reads not certified)",
        (
            "keys | values",
            "samples",
            "accuracy",
            "Δ vs dense [95% CI] (pp)",
            "McNemar p",
            "same tokens",
            "capacity",
            "promoted",
            "capacity after",
            "page-in ×fp16",
        ),
        tuple(out),
        "Every column empirical. Δ: paired bootstrap over the same samples; McNemar: exact, on all-correct answers; "
        "same tokens: continuations token-identical to dense; capacity: fp16 K/V over the measured bytes per token and "
        "KV head of each tier's packed tensors plus the log8 witnesses, mixed by the heavy share (nominal per token). "
        "Promoting rows (a simulated token-granular gate at τ = 0.2 on min(Tier A, Tier B uniform-law) radii, whose "
        "repair moves tokens to the heavy tier): promoted = mean share of the prompt tokens moved (every layer and KV "
        "head), with the share of reads that failed even fully promoted (served exact) in brackets; capacity after = "
        "with the promoted tokens at the heavy codecs' bytes; page-in = each promoted token's fp16 key (and value, "
        "kv) once, over the prompt's fp16 K/V.",
    )


def promotion_cells(m: Measured, row: Row) -> tuple[str, str, str]:
    """The promotion columns of ``row``: promoted share (failed reads), capacity after, page-in (``–`` for a row
    that does not promote)."""
    share = m.promoted.get(row.label)
    if not row.promote or not share:
        return ("–", "–", "–")
    mean = sum(share) / len(share)
    failed = sum(m.failed[row.label]) / len(m.failed[row.label])
    per_token = 1.0 if row.promote == "kv" else 0.5  # the fp16 K (and V) of a promoted token, over its fp16 K/V
    return (f"{mean:.3f} ({failed:.1%})", f"{m.capacity(row):.2f}×", f"{mean * per_token:.3f}")


def plot(m: Measured, path: Path, model: str) -> None:
    dense = m.accuracy("dense")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for row in m.rows:
        ci = paired_bootstrap(m.scores["dense"], m.scores[row.label])
        acc, cap = m.accuracy(row.label), m.capacity(row)
        yerr = [[max(acc - dense - ci.low, 0)], [max(dense + ci.high - acc, 0)]]
        ax.errorbar([cap], [acc], yerr=yerr, fmt="o", capsize=3, label=f"{row.label} ({cap:.2f}×)")
    ax.axhline(dense, color="k", linestyle="--", linewidth=1, label="dense")
    ax.set_xlabel("capacity: fp16 K/V / tiered bytes per token (measured per tier, nominal mix)")
    ax.set_ylabel("RULER accuracy (empirical)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"{model}: token tiers, accuracy vs capacity; whiskers: dense + paired 95% CI of Δ", fontsize=8)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


def head_dim_of(model: str) -> int:
    """The head dimension of ``model`` from its converted config (no weights loaded)."""
    cfg = AutoConfig.from_pretrained(str(converted_dir(model)), local_files_only=True)
    return int(cfg.get_text_config().head_dim)


def report(args: argparse.Namespace, m: Measured, console: Console) -> None:
    """Print the table; write ``--plot`` and, with ``--out``, the same table in markdown beside ``results.json``."""
    result = table(m, args.model)
    print_table(console, result)
    if args.plot is not None:
        plot(m, args.plot, args.model)
    if args.out is not None:
        (args.out / "table.md").write_text(to_markdown(result) + "\n")


def results_doc(args: argparse.Namespace, m: Measured) -> dict[str, object]:
    """``results.json``: the configuration, every row's numbers with their tier, the per-sample scores and texts."""
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "head_dim": m.head_dim,
        "rows": {
            r.label: {
                "accuracy": {"value": m.accuracy(r.label), "tier": EMPIRICAL},
                "capacity": {"value": m.capacity(r), "tier": EMPIRICAL},
                "same_tokens": {"value": m.same[r.label], "tier": EMPIRICAL},
                **(
                    {
                        "promoted": {"value": m.promoted[r.label], "tier": EMPIRICAL},
                        "failed_reads": {"value": m.failed[r.label], "tier": EMPIRICAL},
                    }
                    if r.label in m.promoted
                    else {}
                ),
            }
            for r in m.rows
        },
        "dense_accuracy": {"value": m.accuracy("dense"), "tier": EMPIRICAL},
        "scores": m.scores,
        "texts": m.texts,
    }


def from_results(args: argparse.Namespace, console: Console) -> None:
    """``--report-only``: the table and the figure again from ``--out``'s ``results.json`` (its configuration)."""
    if args.out is None:
        raise SystemExit("--report-only reads --out DIR/results.json: give --out")
    doc = json.loads((args.out / "results.json").read_text())
    config = doc["config"]
    for key in ("model", "light", "heavy", "heavy_fracs", "values"):
        setattr(args, key, config[key])
    args.promote = config.get("promote", "")
    rows = parse_rows(args)
    same = {r.label: int(doc["rows"][r.label]["same_tokens"]["value"]) for r in rows}
    head_dim = int(doc.get("head_dim") or head_dim_of(args.model))
    measured = Measured(rows, head_dim, doc["scores"], same, doc.get("texts", []))
    for r in rows:
        if "promoted" in doc["rows"][r.label]:
            measured.promoted[r.label] = doc["rows"][r.label]["promoted"]["value"]
            measured.failed[r.label] = doc["rows"][r.label]["failed_reads"]["value"]
    report(args, measured, console)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=4, help="samples per task")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--light", default="dither-int5+bypass8")
    ap.add_argument("--heavy", default="dither-int8+bypass8")
    ap.add_argument("--heavy-fracs", default="0,0.2")
    ap.add_argument("--values", default="int2/int4", help="LIGHT/HEAVY value codec pairs")
    ap.add_argument(
        "--promote", default="", help="repair modes, a row each: none, k (keys promoted), kv (keys and values)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=32, help="cap on RULER's per-task budget (0: none)")
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report-only", action="store_true", help="the table and figure again from --out's results")
    args = ap.parse_args()
    console = Console()
    if args.report_only:
        from_results(args, console)
        return
    if args.samples < 1 or args.context < 64:
        raise SystemExit("--samples must be >= 1 and --context >= 64")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    for t in tasks:
        ruler.task_config(t)
    rows = parse_rows(args)
    t0 = time.time()
    loaded = load_model(args.model, args.seed)
    cfg = loaded.model.config.get_text_config()
    delta_loc = ValidationConfig().delta_loc(cfg.num_hidden_layers, cfg.num_attention_heads)
    samples = [
        s for t in tasks for s in ruler.load_task(t, args.context, args.samples, args.seed, loaded.tokenizer_dir)
    ]
    m = Measured(
        rows,
        loaded.model.config.head_dim,
        {"dense": [], **{r.label: [] for r in rows}},
        dict.fromkeys((r.label for r in rows), 0),
    )
    with progress_bar(f"samples (dense + {len(rows)} rows each)", len(samples), console) as tick:
        for sample in samples:
            ids = prompt_ids(loaded.tokenizer, sample)
            budget = min(sample.max_new_tokens, args.max_new_tokens or sample.max_new_tokens)  # needles: a few tokens
            seen = capture(loaded.model, ids)
            prefill = exact_prefill(loaded.model, ids)
            dense = greedy_from(
                loaded.model, prefill.first, copy_cache(loaded.model, prefill.cache), budget, loaded.eos_ids
            )
            text = {"dense": loaded.tokenizer.decode(dense, skip_special_tokens=True)}
            m.scores["dense"].append(ruler.score(sample, text["dense"]))
            masks = {}
            for row in rows:
                if row.frac not in masks:
                    masks[row.frac] = heavy_masks(seen, row.tiers)
                cache, promoter = tiered_cache(loaded.model, prefill.cache, masks[row.frac], row, args.seed, delta_loc)
                if promoter is None:
                    toks = greedy_from(loaded.model, prefill.first, cache, budget, loaded.eos_ids)
                else:
                    with swapped_attention(loaded.model, "kvcert-tier-promotion", promoter.attend, mask=None):
                        toks = greedy_from(loaded.model, prefill.first, cache, budget, loaded.eos_ids)
                    m.promoted.setdefault(row.label, []).append(promoter.share())
                    m.failed.setdefault(row.label, []).append(promoter.failed / max(promoter.reads, 1))
                text[row.label] = loaded.tokenizer.decode(toks, skip_special_tokens=True)
                m.scores[row.label].append(ruler.score(sample, text[row.label]))
                m.same[row.label] += toks == dense
            m.texts.append({"task": sample.task, "index": str(sample.index), **text})
            tick(0)
    console.print(f"{len(samples)} samples in {time.time() - t0:.0f} s")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results_doc(args, m), indent=1))
    report(args, m, console)


if __name__ == "__main__":
    main()
