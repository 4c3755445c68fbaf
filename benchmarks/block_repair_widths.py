"""Question: under block repair, how many of each KV head's tokens must be held exact at each dithered key width, and
would a width per (layer, KV head) chosen for block repair save device bytes?

``--model`` (real weights, offline), ``--prompts`` windows of ``--tokens`` tokens of the calibration corpus (``kjv``,
as ``kvcert allocate`` takes them; never RULER's haystack), each decoded for ``--steps`` greedy tokens once per key
width of ``--widths`` with ``--values`` values under the block-granular persistent gate ``kvcert eval --gate auto``
gives informative schemes (``Gate.certified(0.2)``, 64-token blocks written back exact) with **no** device budget, so
every block a read needs stays held and the held share is the gate's demand, not what a budget let through.

Per (layer, KV head) and width ``b``, measured at the end of each prompt: the share ``h_b`` of the head's live key
and value entries held exact, and the device bytes per token-head ``c_b + v + h_b·2·D·2`` (key codes and scales
``c_b``, value codes ``v``, both measured from encoded tensors, plus the held entries at 16 bits; the witnesses are
the same for every width and left out). A block-repair allocation gives each head the width of fewest such bytes;
the table compares it with every head at one width. Tiers: held shares and bytes measured (empirical, these
prompts). Writes ``--plot`` (held share per width, one box per width).
Run: ``OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/block_repair_widths.py --model smollm2-135m``.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console

from kvcert import CertifiedCache, Gate, StorageConfig
from kvcert.cli.common import CERTIFIED_TAU, REPAIR_BLOCK, load_model
from kvcert.cli.progress import progress_bar
from kvcert.eval.bit_calibration import calibration_ids
from kvcert.quant import bytes_per_token_head, get, resolve
from kvcert.report.tables import ReportTable, print_table

GATE = Gate.certified(CERTIFIED_TAU, granularity="block", block_size=REPAIR_BLOCK, persistent=True)


def held_shares(model, ids: torch.Tensor, keys: str, values: str, steps: int, seed: int) -> torch.Tensor:
    """``[L, Hkv]``: the share of each KV head's live K and V entries held exact after decoding ``steps`` tokens of
    ``ids`` under :data:`GATE` without a device budget (batch row 0; layers that store nothing are NaN)."""
    cache = CertifiedCache(
        model, seed=seed, gate=GATE, storage=StorageConfig(keys=keys, values=values, device_budget=None)
    )
    try:
        model.generate(ids, cache=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
        rows = []
        for layer in cache.layers:
            st = layer.store
            if st.k is None or st.v is None or st.n == 0:
                rows.append(torch.full((model.config.get_text_config().num_key_value_heads,), float("nan")))
                continue
            held = st.k.held.view()[0, :, : st.n].double().mean(-1) + st.v.held.view()[0, :, : st.n].double().mean(-1)
            rows.append(held / 2)
        return torch.stack(rows)
    finally:
        cache.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--widths", default="8,6,5,4,3", help="dithered key widths, comma-separated")
    ap.add_argument("--values", default="int4", help="value codec of every width")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", metavar="PNG", help="also write the held shares per width as a figure")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    torch.set_num_threads(1)
    loaded = load_model(args.model, args.seed)
    ids = calibration_ids(loaded.tokenizer, "kjv", args.tokens, args.prompts, args.seed)
    head_dim = int(loaded.model.config.get_text_config().head_dim)
    console = Console(width=max(100, Console().width))
    shares: dict[int, torch.Tensor] = {}
    with progress_bar(f"{len(widths)} widths x {args.prompts} prompt(s)", len(widths) * args.prompts, console) as tick:
        for i, b in enumerate(widths):
            per_prompt = []
            for j, x in enumerate(ids):
                per_prompt.append(held_shares(loaded.model, x, f"dither-int{b}", args.values, args.steps, args.seed))
                tick(i * len(ids) + j)
            shares[b] = torch.stack(per_prompt).mean(0)
    value_bytes = bytes_per_token_head(resolve(args.values, "value"), D=head_dim)
    cost = {
        b: bytes_per_token_head(get(f"dither-int{b}"), D=head_dim) + value_bytes + s * 4 * head_dim
        for b, s in shares.items()
    }
    valid = ~torch.isnan(shares[widths[0]])
    stacked = torch.stack([cost[b] for b in widths])  # [W, L, Hkv]
    best = stacked.nan_to_num(float("inf")).argmin(0)
    fp16 = 4 * head_dim
    rows = []
    for i, b in enumerate(widths):
        s = shares[b][valid]
        rows.append(
            (
                f"{b}-bit keys, every head",
                f"{float(s.mean()):.3f}",
                f"{float(s.min()):.3f} / {float(s.median()):.3f} / {float(s.max()):.3f}",
                f"{float(cost[b][valid].mean()):.1f}",
                f"{fp16 / float(cost[b][valid].mean()):.2f}x",
                str(int((best[valid] == i).sum())),
            )
        )
    chosen = stacked.gather(0, best.unsqueeze(0))[0][valid]
    rows.append(
        (
            "block-repair allocation",
            "–",
            "–",
            f"{float(chosen.mean()):.1f}",
            f"{fp16 / float(chosen.mean()):.2f}x",
            str(int(valid.sum())),
        )
    )
    print_table(
        console,
        ReportTable(
            f"block repair (certified(0.2), 64-token blocks, persistent, no budget), {args.model}, {args.prompts} x "
            f"{args.tokens} tokens of kjv, {args.steps} steps, {args.values} values (measured, empirical)",
            (
                "keys",
                "held share, mean over KV heads",
                "held share min / median / max",
                "device B per token-head (codes + held)",
                "capacity vs fp16 K/V (no witnesses)",
                "KV heads whose fewest bytes are at this width",
            ),
            tuple(rows),
        ),
    )
    if args.plot:
        _plot(shares, valid, widths, args.plot, args.model)
        console.print(f"plot: {args.plot}")


def _plot(shares: dict[int, torch.Tensor], valid: torch.Tensor, widths: list[int], path: str, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.boxplot([shares[b][valid].numpy() for b in widths], tick_labels=[f"{b}-bit" for b in widths])
    ax.set_ylabel("share of a KV head's entries held exact")
    ax.set_xlabel("dithered key width")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{model}: block repair at tau = 0.2 (no device budget)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
