"""Which heavy-value allocation leaves the least output error at equal value bytes? Real prompts of a RULER seed run
through the model (eager attention, so the attention is read back); each (layer, KV head)'s prompt tokens are
ranked as token tiers rank them (``kvcert.attention.tier_choice``: the default select policy's prefill scores, its
protected tokens first), and each allocation stores the top shares of that ranking in its codecs and every other
value in the light codec. Over greedy decode steps, every (layer, query head) cell's relative output error
``‖Σ_t p_t Δv_t‖ / ‖Σ_t p_t v_t‖`` over the prompt's tokens (``p`` the step's real attention) is measured, with the
value bytes per token and KV head measured from the packed tensors. Keys are exact: only the values' share of the
output error is read. Also each codec's relative residual over the prompt values. Every number is measured (empirical).
``docs/read-path.md#heavy-values``.

Usage: ``OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/value_allocation.py --seed 901
--tasks niah_single_3,niah_multikey_1,niah_multikey_2 --samples 2 --light int2,minmax-int2
--allocations "int4@0.3;int8@0.1;int8@0.15;int8@0.1,minmax-int4@0.2;int8@0.3" [--steps 10] [--plot PNG]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib
import torch
from rich.console import Console

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvcert.attention.evict_driver import default_select  # noqa: E402
from kvcert.attention.tier_choice import heavy_count  # noqa: E402
from kvcert.cli.common import load_model  # noqa: E402
from kvcert.cli.progress import progress_bar  # noqa: E402
from kvcert.eval import ruler  # noqa: E402
from kvcert.eval.harness import prompt_ids  # noqa: E402
from kvcert.evict.base import keep_top  # noqa: E402
from kvcert.quant import DitherKey, resolve  # noqa: E402
from kvcert.report.tables import ReportTable, print_table  # noqa: E402

Allocation = tuple[tuple[str, float], ...]  # (codec, share) from the top of the ranking down


def parse_allocations(text: str) -> list[Allocation]:
    """``"c@f,c@f;c@f"``: allocations separated by ``;``, each a list of ``codec@share`` from the top down."""
    out = []
    for item in text.split(";"):
        parts = [p.split("@") for p in item.split(",") if p.strip()]
        if not parts or any(len(p) != 2 for p in parts):
            raise ValueError(f"--allocations: expected codec@share[,codec@share...], got {item!r}")
        alloc = tuple((name.strip(), float(share)) for name, share in parts)
        if not all(0.0 < s < 1.0 for _, s in alloc) or sum(s for _, s in alloc) >= 1.0:
            raise ValueError(f"--allocations: shares must lie in (0, 1) and sum below 1, got {item!r}")
        out.append(alloc)
    return out


def label(light: str, alloc: Allocation) -> str:
    return " + ".join(f"{int(round(100 * s))}% {c}" for c, s in alloc) + f", light {light}"


def _residuals(v: torch.Tensor, names: set[str], layer: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Per codec: ``Δv = v̂ − v`` of the layer's values ``v[Hkv, S, D]`` and its bytes per token and KV head."""
    res, nbytes = {}, {}
    s = v.shape[1]
    for name in names:
        codec = resolve(name, "value")
        key = DitherKey(0, torch.zeros(1, dtype=torch.int64), layer, torch.arange(s)[None]) if codec.needs_key else None
        packed, decoded = codec.encode_decode(v[None], key=key)
        res[name] = decoded[0].to(torch.float32) - v
        nbytes[name] = packed.nbytes / (v.shape[0] * s)
    return res, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", required=True)
    ap.add_argument("--samples", type=int, default=2, help="samples per task")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--seed", type=int, required=True, help="RULER data seed (a calibration seed, not an eval one)")
    ap.add_argument("--light", required=True, help="comma-separated light value codecs")
    ap.add_argument("--allocations", required=True, help="'codec@share[,codec@share];...' from the top down")
    ap.add_argument("--steps", type=int, default=10, help="greedy decode steps read per sample")
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    try:
        allocs = parse_allocations(args.allocations)
    except ValueError as err:
        ap.error(str(err))
    lights = [c.strip() for c in args.light.split(",") if c.strip()]
    names = set(lights) | {c for a in allocs for c, _ in a}
    loaded = load_model(args.model, args.seed)
    model = loaded.model
    model.config._attn_implementation = "eager"  # the attention probabilities come back from the forward
    policy = default_select()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    samples = [
        s for t in tasks for s in ruler.load_task(t, args.context, args.samples, args.seed, loaded.tokenizer_dir)
    ]
    errors: dict[tuple[str, Allocation], list[torch.Tensor]] = {(lt, a): [] for lt in lights for a in allocs}
    sq_err = dict.fromkeys(sorted(names), 0.0)  # per codec: Σ‖Δv_t‖² and Σ‖v_t‖² over every prompt value
    sq_val, codec_bytes = 0.0, dict.fromkeys(sorted(names), 0.0)
    value_bytes: dict[tuple[str, Allocation], list[float]] = {key: [] for key in errors}
    console = Console()
    with progress_bar("samples", len(samples), console) as advance, torch.no_grad():
        for sample in samples:
            ids = torch.as_tensor(prompt_ids(loaded.tokenizer, sample)).view(1, -1)
            out = model(input_ids=ids, use_cache=True, output_attentions=True)
            cache, s = out.past_key_values, ids.shape[1]
            layers = []
            for i, attn in enumerate(out.attentions):
                keys, values = cache.layers[i].keys.float(), cache.layers[i].values.float()
                scores, protected = policy.prefill_scores(i, keys, values, attn=attn.float(), kappa=torch.ones(1, s))
                residuals, nbytes = _residuals(values[0], names, i)
                sq_val += float(values.square().sum())
                for name in names:
                    sq_err[name] += float(residuals[name].square().sum())
                    codec_bytes[name] = nbytes[name]
                layers.append((values[0], scores, protected, residuals, nbytes))
            served = {}
            for key in errors:
                light, alloc = key
                per_layer, total_bytes = [], 0.0
                for _values, scores, protected, residuals, nbytes in layers:
                    err, above, top = residuals[light].clone(), torch.zeros_like(protected[0]), 0.0
                    for name, share in alloc:  # nested top sets of one ranking: each tier is the next slice of it
                        top += share
                        kept = keep_top(scores, protected, heavy_count(s, top, policy))[0]  # [Hkv, C]
                        upto = torch.zeros_like(above).scatter(1, kept, True)
                        tier = upto & ~above
                        err = torch.where(tier.unsqueeze(-1), residuals[name], err)
                        total_bytes += nbytes[name] * float(tier.float().mean())
                        above = upto
                    total_bytes += nbytes[light] * float((~above).float().mean())
                    per_layer.append(err)
                served[key] = per_layer
                value_bytes[key].append(total_bytes / len(layers))
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(args.steps):
                step = model(input_ids=tok, cache=cache, use_cache=True, output_attentions=True)
                tok = step.logits[:, -1].argmax(-1, keepdim=True)
                for i, attn in enumerate(step.attentions):
                    hkv = layers[i][0].shape[0]
                    p = attn[0, :, 0, :s].float().view(hkv, -1, s)  # the prompt's tokens, per KV head's group
                    ref = torch.einsum("hgs,hsd->hgd", p, layers[i][0]).norm(dim=-1)
                    for key, per_layer in served.items():
                        e = torch.einsum("hgs,hsd->hgd", p, per_layer[i]).norm(dim=-1)
                        errors[key].append((e / ref.clamp_min(1e-30)).flatten())
            advance(1)
    rows, points = [], []
    for (light, alloc), errs in errors.items():
        r = torch.cat(errs)
        vb = sum(value_bytes[(light, alloc)]) / len(value_bytes[(light, alloc)])
        q = torch.quantile(r, torch.tensor([0.5, 0.9, 0.99]))
        rows.append((label(light, alloc), f"{vb:.1f}", f"{r.mean():.4f}", *(f"{x:.4f}" for x in q.tolist())))
        points.append((label(light, alloc), vb, float(r.mean())))
    print_table(
        console,
        ReportTable(
            f"relative output error of the values, {len(samples)} samples × {args.steps} decode steps, every "
            f"(layer, query head) cell ({args.model}, seed {args.seed})",
            ("allocation", "value B / token, KV head", "mean", "p50", "p90", "p99"),
            rows,
            "Tier: every number measured (empirical); keys exact, prompt tokens only.",
        ),
    )
    print_table(
        console,
        ReportTable(
            "each codec's relative value residual over every prompt value, sqrt(Σ‖Δv_t‖² / Σ‖v_t‖²)",
            ("codec", "B / token, KV head", "relative residual"),
            [(name, f"{codec_bytes[name]:.1f}", f"{(sq_err[name] / sq_val) ** 0.5:.4f}") for name in sq_err],
            "Tier: measured (empirical).",
        ),
    )
    if args.plot is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, x, y in points:
            ax.scatter([x], [y])
            ax.annotate(name, (x, y), fontsize=7, xytext=(4, 2), textcoords="offset points")
        ax.set_xlabel("value bytes per token and KV head (measured)")
        ax.set_ylabel("mean relative output error (measured)")
        ax.set_title(f"value allocations on {args.model}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
