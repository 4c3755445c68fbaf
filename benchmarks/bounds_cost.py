"""Cost of the Tier-A certificate (radii + meter) relative to the attention it certifies.

One decode step of a 30-layer model with 9 query heads, 3 KV heads (GQA, G=3), head dim 64, batch 1.
Per layer, side by side in one run:

* attention: ``q·Kᵀ`` (float32), softmax, ``·V`` — the read being certified;
* certificate: query band norms (8 bands of whole RoPE pairs), Tier-A radii ``c = sc·ρ·‖q_b‖`` (one batched
  matmul against the stored key band norms), and ``meter = min(1, eform, two_sided, ptm)`` in float64,
  (a) called per layer, as the cache does, and (b) batched over all layers in one call (same math; shows
  how much of (a) is per-call overhead);
* fused read: what the CPU read path runs now for decode — :func:`kvcert.kernels.numba_read.logits_radii` (served
  logits, band norms, radii and the float32 logit slack in one pass over token-major allocations) and
  :func:`kvcert.kernels.numba_read.meter_output` (served softmax, meter, tanh reference, output ``p̃·v̂`` and the
  output bound's terms), per layer. It computes the attention itself too, so its certificate cost is
  reported as ``(fused read − attention) / attention``.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bounds_cost.py [--seq 512 1024 ...] [--repeats 7]``
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from kvcert.bounds import (
    band_norms,
    meter_and_unclipped,
    norm_up_f32,
    query_band_norms,
    round_up_f32,
    tier_a_radius_from_qnorms,
)
from kvcert.bounds.rc import gamma_f32
from kvcert.kernels.numba_read import logits_radii, meter_output

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BANDS = 30, 9, 3, 64, 8
GROUP = HEADS // KV_HEADS
SCALE = HEAD_DIM**-0.5


def make_layers(seq: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    layers = []
    for _ in range(LAYERS):
        k = torch.randn(KV_HEADS, seq, HEAD_DIM, generator=gen)
        v = torch.randn(KV_HEADS, seq, HEAD_DIM, generator=gen)
        k_res = torch.randn(KV_HEADS, seq, HEAD_DIM, generator=gen) * 1e-2
        q = torch.randn(KV_HEADS, GROUP, HEAD_DIM, generator=gen)
        # stored witness, band-major [Hkv, 1, B, S] (float32 rounded up), passed as a [Hkv, 1, S, B] view
        kn = round_up_f32(band_norms(k_res, BANDS)).transpose(-1, -2).contiguous().unsqueeze(1)
        # the cache's token-major witnesses [1, Hkv, S, B], ‖k̂_t‖ and W_t [1, Hkv, S] for the fused path
        fused = {
            "rho": kn.squeeze(1).transpose(-1, -2).contiguous().unsqueeze(0),
            "khn": norm_up_f32(k).unsqueeze(0),
            "w": norm_up_f32(k_res).unsqueeze(0),
            "k4": k.unsqueeze(0),
            "v4": v.unsqueeze(0),
            "vn": norm_up_f32(v).unsqueeze(0),
            "vres": torch.rand(1, KV_HEADS, seq, generator=gen) * 1e-2,
        }
        layers.append({"q": q, "k": k, "v": v, "kn": kn, **fused})
    return layers


def attention(layer: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(layer["q"], layer["k"].transpose(-1, -2)) * SCALE
    p = torch.softmax(scores, dim=-1)
    return torch.matmul(p, layer["v"]), p


def certificate(layer: dict[str, torch.Tensor], p: torch.Tensor) -> torch.Tensor:
    qn = query_band_norms(layer["q"], BANDS)
    c = tier_a_radius_from_qnorms(qn, layer["kn"].transpose(-1, -2), SCALE)
    return meter_and_unclipped(p, c)[0]


def fused_read(layer: dict[str, torch.Tensor]) -> torch.Tensor:
    s = layer["k4"].shape[2]
    lr = logits_radii(
        layer["q"].unsqueeze(0),
        layer["k4"],
        layer["rho"],
        layer["khn"],
        layer["w"],
        s,
        SCALE,
        gamma_f32(HEAD_DIM + 1),
        "rotate_half",
    )
    assert lr is not None
    mo = meter_output(lr, layer["v4"], layer["vres"], layer["vn"], layer["vn"], s)
    assert mo is not None
    return mo.cert


def paired_times(fns: list, repeats: int) -> list[float]:
    """Median CPU times (process_time) of functions measured alternately, so that load from other
    processes on a shared machine neither inflates nor biases one side."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, acc in zip(fns, times, strict=True):
            t0 = time.process_time()
            fn()
            acc.append(time.process_time() - t0)
    return [sorted(t)[repeats // 2] for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=11)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for seq in tqdm(args.seq, desc="sequence lengths"):
        layers = make_layers(seq, gen)
        probs = [attention(layer)[1] for layer in layers]

        def run_attention(layers=layers) -> None:
            for layer in layers:
                attention(layer)

        def run_certificate(layers=layers, probs=probs) -> None:
            for layer, p in zip(layers, probs, strict=True):
                certificate(layer, p)

        # all layers' stored witnesses in one tensor; served rows stacked once per step (timed)
        kn_all = torch.stack([layer["kn"] for layer in layers])
        q_all = torch.stack([layer["q"] for layer in layers])

        def run_batched(probs=probs, kn_all=kn_all, q_all=q_all) -> None:
            c = tier_a_radius_from_qnorms(query_band_norms(q_all, BANDS), kn_all.transpose(-1, -2), SCALE)
            meter_and_unclipped(torch.stack(probs), c)

        def run_fused(layers=layers) -> None:
            for layer in layers:
                fused_read(layer)

        run_attention(), run_certificate(), run_batched(), run_fused()  # warm-up
        rows.append((seq, *paired_times([run_attention, run_certificate, run_batched, run_fused], args.repeats)))
    print(f"threads={torch.get_num_threads()} L={LAYERS} H={HEADS} Hkv={KV_HEADS} D={HEAD_DIM} B={BANDS}")
    print("per-layer: one certificate call per layer (as the cache reads); batched: one call for all layers")
    print(
        "fused read: served attention + certificate in the decode kernels; its ratio is (fused - attention) / attention"
    )
    head = ("S", "attention ms", "per-layer ms", "ratio", "batched ms", "ratio", "fused read ms", "ratio")
    print(" | ".join(f"{h:>{w}}" for h, w in zip(head, (6, 12, 12, 6, 10, 6, 13, 6), strict=True)))
    print("-" * 90)
    for seq, t_att, t_cert, t_batch, t_fused in rows:
        print(
            f"{seq:>6} | {1e3 * t_att:>12.2f} | {1e3 * t_cert:>12.2f} | {t_cert / t_att:>6.3f} | "
            f"{1e3 * t_batch:>10.2f} | {t_batch / t_att:>6.3f} | {1e3 * t_fused:>13.2f} | "
            f"{(t_fused - t_att) / t_att:>6.3f}"
        )


if __name__ == "__main__":
    main()
