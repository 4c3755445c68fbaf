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

Reported per row: accuracy, the paired bootstrap 95 % CI of (row − dense) and the exact McNemar p over the same
samples, how many continuations are token-identical to dense, and the capacity; all empirical. ``--plot`` draws
accuracy (with dense + CI whiskers) against capacity; ``--out`` writes ``results.json`` (every number with its tier).

Usage: ``OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/token_tier_accuracy.py [--model gemma3-270m]
[--tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2] [--context 2048] [--samples 4]
[--seed 5] [--light dither-int5+bypass8] [--heavy dither-int8+bypass8] [--heavy-fracs 0,0.2] [--values int2/int4]
[--max-new-tokens 32] [--plot FILE] [--out DIR]``; ``--report-only --out DIR [--plot FILE]`` prints the
table and draws the figure again from ``DIR/results.json``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcert.cli.common import load_model  # noqa: E402
from kvcert.cli.progress import progress_bar  # noqa: E402
from kvcert.eval import ruler  # noqa: E402
from kvcert.eval.branching import copy_cache, exact_prefill, greedy_from  # noqa: E402
from kvcert.eval.harness import prompt_ids  # noqa: E402
from kvcert.eval.stats import mcnemar, paired_bootstrap  # noqa: E402
from kvcert.models.zoo import converted_dir  # noqa: E402
from kvcert.quant import bytes_per_token_head, get, sample_key  # noqa: E402
from kvcert.report.tables import ReportTable, fmt, print_table, to_markdown  # noqa: E402
from tv_box_tightness import Tiers, heavy_tokens, key_bytes  # noqa: E402
from witness_tightness import Captured, capture  # noqa: E402

EMPIRICAL = "empirical"


@dataclass(frozen=True)
class Row:
    """One configuration: light and heavy key codecs, the heavy share, and the (light, heavy) value codecs."""

    light: str
    heavy: str
    frac: float
    values: tuple[str, str]

    @property
    def tiers(self) -> Tiers | None:
        return Tiers(self.heavy, self.frac) if self.frac > 0 else None

    @property
    def label(self) -> str:
        keys = self.light if self.frac == 0 else f"{self.light} + {self.frac:.0%} {self.heavy}"
        vals = self.values[0] if self.frac == 0 else "/".join(self.values)
        return f"{keys} | V {vals}"

    def capacity(self, head_dim: int) -> float:
        """fp16 K/V bytes over the row's nominal bytes per token and KV head (measured per tier, mixed by the share)."""
        light_v, heavy_v = (bytes_per_token_head(get(v), head_dim) for v in self.values)
        kv = key_bytes(self.light, self.tiers, head_dim) + (1 - self.frac) * light_v + self.frac * heavy_v
        return 4 * head_dim / kv


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


def served(
    x: torch.Tensor, heavy: torch.Tensor, light_codec: str, heavy_codec: str, seed: int, layer: int
) -> torch.Tensor:
    """``x[1, Hkv, n, D]`` (the layer's last ``n`` prompt positions) as the tiers serve it: heavy tokens
    (``heavy[Hkv, n]``) through ``heavy_codec``, the rest through ``light_codec``, each encoded with the codec's own
    per-token scales over the whole layer (so a token's code does not depend on its tier's other tokens)."""
    x32 = x.to(torch.float32)
    out = []
    for name in (light_codec, heavy_codec) if bool(heavy.any()) else (light_codec,):
        codec = get(name)
        if codec.block != 1 or codec.residual_window:
            raise ValueError(f"token tiers need per-token codecs; {name!r} encodes blocks of tokens")
        key = sample_key(x32, seed, layer) if codec.needs_key else None
        out.append(codec.encode_decode(x32, key)[1])
    if len(out) == 1:
        return out[0].to(x.dtype)
    return torch.where(heavy[None, :, :, None], out[1], out[0]).to(x.dtype)


def tiered_cache(model, prefill_cache, masks: list[torch.Tensor], row: Row, seed: int):  # noqa: ANN001, ANN201
    """A copy of the exact prefill whose prompt keys and values are what ``row``'s tiers serve."""

    def transform(i: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heavy = masks[i][:, -keys.shape[2] :]  # a sliding-window layer holds only its last positions
        return (
            served(keys, heavy, row.light, row.heavy, seed, i),
            served(values, heavy, row.values[0], row.values[1], seed, i),
        )

    return copy_cache(model, prefill_cache, transform)


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
    rows = {Row(args.light, args.heavy, f, p if f > 0 else (p[0], p[0])) for f in fracs for p in pairs}
    return sorted(rows, key=lambda r: (r.frac, r.values))


@dataclass
class Measured:
    """What a run measured, for the table, the figure and ``results.json``: per row (and ``"dense"``) the per-sample
    scores, per row the continuations token-identical to dense, the head dimension its capacity needs, the texts."""

    rows: list[Row]
    head_dim: int
    scores: dict[str, list[float]]
    same: dict[str, int]
    texts: list[dict[str, str]] = field(default_factory=list)

    def accuracy(self, label: str) -> float:
        """Mean score of ``label`` (a row's label or ``"dense"``) over the samples."""
        return sum(self.scores[label]) / len(self.scores[label])


def table(m: Measured, model: str) -> ReportTable:
    dense = m.scores["dense"]
    out = [("dense", str(len(dense)), fmt(m.accuracy("dense"), percent=True), "–", "–", "–", "1")]
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
            )
        )
    return ReportTable(
        f"Token tiers on {model}: RULER accuracy of the served prompt K/V against dense (reads not certified)",
        ("keys | values", "samples", "accuracy", "Δ vs dense [95% CI] (pp)", "McNemar p", "same tokens", "capacity"),
        tuple(out),
        "Every column empirical. Δ: paired bootstrap over the same samples; McNemar: exact, on all-correct answers; "
        "same tokens: continuations token-identical to dense; capacity: fp16 K/V over the measured bytes per token and "
        "KV head of each tier's packed tensors plus the log8 witnesses, mixed by the heavy share (nominal per token).",
    )


def plot(m: Measured, path: Path, model: str) -> None:
    dense = m.accuracy("dense")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for row in m.rows:
        ci = paired_bootstrap(m.scores["dense"], m.scores[row.label])
        acc, cap = m.accuracy(row.label), row.capacity(m.head_dim)
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
                "capacity": {"value": r.capacity(m.head_dim), "tier": EMPIRICAL},
                "same_tokens": {"value": m.same[r.label], "tier": EMPIRICAL},
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
    rows = parse_rows(args)
    same = {r.label: int(doc["rows"][r.label]["same_tokens"]["value"]) for r in rows}
    head_dim = int(doc.get("head_dim") or head_dim_of(args.model))
    report(args, Measured(rows, head_dim, doc["scores"], same, doc.get("texts", [])), console)


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
                cache = tiered_cache(loaded.model, prefill.cache, masks[row.frac], row, args.seed)
                toks = greedy_from(loaded.model, prefill.first, cache, budget, loaded.eos_ids)
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
