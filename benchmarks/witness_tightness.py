"""How informative are Tier-A key certificates at <= 4.5 bits? Informative fraction and stored bits per element
of each key codec + witness on SmolLM2-135M (or another model, ``--model``: Gemma-3-270m, a local transformers
folder), keys and queries captured from a real forward over corpus text.

Per sample: ``--tokens`` tokens of a corpus at a seeded offset, one forward with an attention function that
records the post-RoPE queries and keys of every layer; then, per (layer, query head) and each of the last
``--queries`` positions (a decode-like read over the whole causal prefix; a sliding-window layer reads its window,
as the model does), the served distribution
``p̃ = softmax(sc·q·k̂)`` and the Tier-A radii ``c_t = sc·Σ_b ‖q_b‖ρ_{t,b}`` from the codec's residual band norms
over whole RoPE pairs (exactly what the store keeps), and the unclipped meter. Columns:

* ``informative`` — fraction of cells whose unclipped meter is < 1 (**certified**: the radii are sound for any
  query, checked here per token: ``violations`` must be 0);
* ``median meter``;
* ``bits/elt`` — codec bytes measured from the packed tensors (codes + scales + zero points) ×8 / elements,
  ``+ witness`` adds the band norms at the float32 the store keeps (``bands × 32 / D``); a window of ``W``
  exact recent tokens adds its fp16 bytes at this context length;
* ``oracle informative`` — the meter with the radius set to the true ``|ε_t|`` of this query (**empirical**, not a
  certificate: no witness can be tighter, so it is the ceiling of any Tier-A witness for that codec).

``qsw-k`` is the query-subspace witness of :class:`kvcert.quant.QuerySubspaceWitness`
(``docs/math.md#query-subspace-witness``): ``U`` the top-``k`` eigenvectors of the post-RoPE queries of each
(layer, KV head), calibrated on ``--calib-corpus`` (another corpus than the one measured); per token ``Uᵀr`` at 8 or
4 bits with bounds on its code error and on the residual outside the span, its bytes measured from the stored
tensors (the basis, stored once per layer, is not counted per token). The ``dither-int5/6`` rows spend the same or
fewer bits on the key codes instead.

The query-subspace ranks are ``D/4``, ``D/2`` and ``3D/4`` of the model's head dimension ``D``.

Usage: ``OMP_NUM_THREADS=2 .venv/bin/python benchmarks/witness_tightness.py [--model smollm2-135m] [--samples 2]
[--tokens 2048] [--queries 32] [--corpus pg-essays] [--calib-corpus kjv] [--seed 1]``
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcert.bounds import band_norms, meter_and_unclipped, tier_a_radius
from kvcert.eval.corpora import load_corpus
from kvcert.integrations.attention_impl import swapped_attention
from kvcert.models.zoo import load
from kvcert.quant import QuerySubspaceWitness, calibrate_basis, get
from kvcert.quant.base import sample_key


@dataclass(frozen=True)
class Candidate:
    """A key codec, its witness bands, an exact recent-token window and (qsw) a query-subspace rank and code width."""

    label: str
    codec: str
    options: dict[str, int]
    bands: int = 8
    window: int = 0
    qsw_rank: int = 0
    qsw_bits: int = 8


def candidates(d: int) -> tuple[Candidate, ...]:
    """The rows for head dimension ``d``: the query-subspace ranks are ``d/4``, ``d/2`` and ``3d/4``."""
    quarter, half = d // 4, d // 2
    return (
        Candidate("int4 (g32) + 8 RoPE bands", "int4", {}),
        Candidate("kivi-4 + 8 RoPE bands", "kivi-4", {}),
        Candidate("hadamard-int4 + 1 band", "hadamard-int4", {}, bands=1),
        Candidate("hadamard-int4 + 8 RoPE bands", "hadamard-int4", {}),
        Candidate("hadamard-int4 (g32) + 32 RoPE bands", "hadamard-int4", {"group_size": 32}, bands=32),
        Candidate(f"hadamard-int4 + qsw-{quarter} (int8)", "hadamard-int4", {}, bands=1, qsw_rank=quarter),
        Candidate(f"hadamard-int4 + qsw-{half} (int4)", "hadamard-int4", {}, bands=1, qsw_rank=half, qsw_bits=4),
        Candidate(f"hadamard-int4 + qsw-{half} (int8)", "hadamard-int4", {}, bands=1, qsw_rank=half),
        Candidate(f"hadamard-int4 + qsw-{3 * quarter} (int8)", "hadamard-int4", {}, bands=1, qsw_rank=3 * quarter),
        Candidate("hadamard-int4 + 8 bands + window 32", "hadamard-int4", {}, window=32),
        Candidate("hadamard-int4 + 8 bands + window 128", "hadamard-int4", {}, window=128),
        Candidate("hadamard-int2 + 8 RoPE bands", "hadamard-int2", {}),
        Candidate("dither-int5 + 8 RoPE bands", "dither-int5", {}),
        Candidate("dither-int6 + 8 RoPE bands", "dither-int6", {}),
        Candidate("int8 (g32) + 8 RoPE bands", "int8", {}),
    )


@dataclass(frozen=True)
class Captured:
    """One forward's post-RoPE queries ``[Hq, T, D]`` and keys ``[Hkv, T, D]`` per layer (float64), the softmax
    scale, and each layer's sliding window (``None``: global attention; a key is visible at distance ``< window``)."""

    qs: list[torch.Tensor]
    ks: list[torch.Tensor]
    scale: float
    windows: list[int | None]


def capture(model: torch.nn.Module, ids: torch.Tensor) -> Captured:
    """The :class:`Captured` queries, keys, scale and sliding windows of one forward over ``ids``."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor, float, int | None]] = {}

    def record(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):  # noqa: ANN001, ANN003
        window = kw.get("sliding_window")
        seen[module.layer_idx] = (query[0].to(torch.float64), key[0].to(torch.float64), float(scaling), window)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw)

    # the model's own mask function (mask=None): the capture changes nothing the forward computes
    with swapped_attention(model, "kvcert-witness-capture", record, mask=None), torch.no_grad():
        model(ids)
    rows = [seen[i] for i in sorted(seen)]
    return Captured([r[0] for r in rows], [r[1] for r in rows], rows[0][2], [r[3] for r in rows])


def texts(corpus: str, n: int, tokens: int, seed: int) -> list[str]:
    text = load_corpus(corpus)
    rng = random.Random(seed)
    span = tokens * 8
    return [text[o : o + span] for o in (rng.randrange(0, len(text) - span) for _ in range(n))]


def subspaces(seen: Captured, rank: int) -> list[torch.Tensor]:
    """Per layer, the bases ``[Hkv, D, rank]`` of :func:`~kvcert.quant.calibrate_basis` over each KV head's query
    group in ``seen`` (columns by decreasing eigenvalue: a prefix of ``k`` columns is the rank-``k`` basis)."""
    pairs = zip(seen.qs, seen.ks, strict=True)
    return [calibrate_basis(q.reshape(k.shape[0], -1, q.shape[-1]), rank) for q, k in pairs]


def codec_bits(cand: Candidate, k: torch.Tensor) -> float:
    """Measured codec bits per element of ``k[Hkv, T, D]`` (packed tensors, whole blocks)."""
    codec = get(cand.codec, **cand.options)
    t = k.shape[1] - k.shape[1] % codec.block
    x = k[None, :, :t].to(torch.float32)
    return codec.encode(x, sample_key(x) if codec.needs_key else None).nbytes * 8 / (k.shape[0] * t * k.shape[-1])


def encoded(cand: Candidate, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The keys ``k[Hkv, T, D]`` as the codec serves them, and its per-group quantiser steps ``[Hkv, T, G]`` (float64;
    0 on the exact tokens; ``None`` for a codec without steps). A dithered codec draws its dither from
    :func:`kvcert.quant.base.sample_key` (seed 0, positions ``0..T−1``)."""
    codec = get(cand.codec, **cand.options)
    t = k.shape[1] - k.shape[1] % codec.block
    x = k[None, :, :t].to(torch.float32)
    key = sample_key(x) if codec.needs_key else None
    packed = codec.encode(x, key)
    khat = codec.decode(packed, key)[0].to(torch.float64)
    steps = codec.steps(packed)
    if steps is not None:
        exact_steps = torch.zeros(k.shape[0], k.shape[1] - t, steps.shape[-1], dtype=torch.float64)
        steps = torch.cat([steps[0].to(torch.float64), exact_steps], 1)
    return torch.cat([khat, k[:, t:]], 1), steps  # a trailing partial block stays exact (as the store keeps it)


def served(cand: Candidate, k: torch.Tensor) -> torch.Tensor:
    """The keys ``k[Hkv, T, D]`` as the codec serves them (:func:`encoded`)."""
    return encoded(cand, k)[0]


@dataclass(frozen=True)
class HeadRead:
    """The decode-like reads of one (layer, KV head): its queries ``q[G, nq, D]`` at the last ``nq`` positions, the
    exact and served keys ``k``, ``khat`` ``[S, D]``, the positions as ``pos[1, nq, 1]`` and ``t[1, 1, S]``, and
    which keys each read sees, ``vis[1, nq, S]`` (causal, within the layer's sliding window if it has one)."""

    layer: int
    head: int
    q: torch.Tensor
    k: torch.Tensor
    khat: torch.Tensor
    pos: torch.Tensor
    t: torch.Tensor
    vis: torch.Tensor


def head_reads(seen: Captured, nq: int, serve: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[HeadRead]:
    """Every (layer, KV head) of ``seen``, its keys served by ``serve(k[Hkv, S, D])`` once per layer."""
    for layer, (q, k, window) in enumerate(zip(seen.qs, seen.ks, seen.windows, strict=True)):
        hkv, s, _ = k.shape
        g = q.shape[0] // hkv
        khat = serve(k)
        pos, t = torch.arange(s - nq, s).view(1, nq, 1), torch.arange(s).view(1, 1, s)
        vis = (t <= pos) & (pos - t < window) if window else t <= pos
        for h in range(hkv):
            yield HeadRead(layer, h, q[h * g : (h + 1) * g, s - nq :], k[h], khat[h], pos, t, vis)


def coded_reads(
    seen: Captured, nq: int, names: Sequence[str]
) -> Iterator[tuple[HeadRead, list[tuple[torch.Tensor, torch.Tensor | None]]]]:
    """Every read of :func:`head_reads` with its keys served by the codec ``names[0]``, and per codec of ``names`` the
    :func:`encoded` keys and steps ``[Hkv, S, ...]`` of the read's layer (one encoding per layer and codec)."""
    layer: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def serve(k: torch.Tensor) -> torch.Tensor:
        layer[:] = [encoded(Candidate(name, name, {}), k) for name in names]
        return layer[0][0]

    for r in head_reads(seen, nq, serve):
        yield r, layer


def measure(cand: Candidate, seen: Captured, nq: int, sub: list[torch.Tensor] | None) -> dict[str, torch.Tensor | int]:
    """Unclipped meters (certified and oracle) of every cell, the radius violations, and the measured bytes and
    elements of the qsw witness (0 for band witnesses)."""
    raw, oracle, viol, wit_bytes, elements = [], [], 0, 0, 0
    sc = seen.scale
    for r in head_reads(seen, nq, lambda k: served(cand, k)):
        qq, delta = r.q, r.khat - r.k  # [G, nq, D], [S, D]
        vis, exact = r.vis, r.t > r.pos - cand.window
        if cand.qsw_rank:
            assert sub is not None
            witness = QuerySubspaceWitness(sub[r.layer][r.head : r.head + 1, :, : cand.qsw_rank], cand.qsw_bits)
            packed = witness.encode(r.k[None, None], r.khat[None, None])
            wit_bytes, elements = wit_bytes + packed.nbytes, elements + r.k.numel()
            g, nq, d = qq.shape
            c = witness.radius(packed, qq.reshape(1, 1, g * nq, d), sc).view(g, nq, -1)
        else:
            rho = band_norms(delta, cand.bands)  # [S, bands]
            c = tier_a_radius(qq, rho.unsqueeze(0), sc)  # [G, nq, S]
        exact_logit = sc * qq @ r.k.T
        logit = torch.where(exact, exact_logit, sc * qq @ r.khat.T)
        eps = (logit - exact_logit).abs()
        c = torch.where(exact | ~vis, 0.0, c)
        viol += int(((eps > c) & vis).sum())
        p = torch.softmax(logit.masked_fill(~vis, float("-inf")), -1)
        raw.append(meter_and_unclipped(p, c)[1].flatten())
        oracle.append(meter_and_unclipped(p, torch.where(vis, eps, 0.0))[1].flatten())
    return {
        "raw": torch.cat(raw),
        "oracle": torch.cat(oracle),
        "violations": viol,
        "witness_bits": wit_bytes * 8 / elements if elements else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="smollm2-135m", help="a zoo name (smollm2-135m, gemma3-270m) or a local transformers folder"
    )
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=32, help="last positions of each sample read as decode steps")
    ap.add_argument("--corpus", default="pg-essays")
    ap.add_argument("--calib-corpus", default="kjv")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.corpus == args.calib_corpus:
        raise SystemExit("--calib-corpus must differ from --corpus (calibrate on one corpus, measure on another)")
    model, tok = load(args.model)
    calib = tok(texts(args.calib_corpus, 1, args.tokens, args.seed)[0], return_tensors="pt").input_ids
    calibration = capture(model, calib[:, : args.tokens])
    d = calibration.qs[0].shape[-1]
    rows = candidates(d)
    sub = subspaces(calibration, max(c.qsw_rank for c in rows))
    results: dict[str, list[dict]] = {c.label: [] for c in rows}
    bits: dict[str, float] = {}
    for text in texts(args.corpus, args.samples, args.tokens, args.seed):
        ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens]
        seen = capture(model, ids)
        s = seen.ks[0].shape[1]
        for cand in rows:
            results[cand.label].append(measure(cand, seen, args.queries, sub))
            base = codec_bits(cand, seen.ks[0])
            wit = results[cand.label][-1]["witness_bits"] if cand.qsw_rank else cand.bands * 32 / d
            win = cand.window / s * (16 - base - wit)
            bits[cand.label] = base + wit + win
            bits[cand.label + " codec"] = base
    print(
        f"{args.model}, {args.corpus} (calibration: {args.calib_corpus}), samples={args.samples} "
        f"tokens={args.tokens} queries/sample={args.queries} seed={args.seed}"
    )
    head = (
        f"{'key codec + witness':40s} | {'codec bits':>10s} | {'all bits':>8s} | {'informative':>11s} | "
        f"{'median meter':>12s} | {'violations':>10s} | {'oracle informative':>18s}"
    )
    print(head)
    print("-" * len(head))
    for cand in rows:
        rs = results[cand.label]
        raw = torch.cat([r["raw"] for r in rs])
        orc = torch.cat([r["oracle"] for r in rs])
        viol = sum(r["violations"] for r in rs)
        print(
            f"{cand.label:40s} | {bits[cand.label + ' codec']:10.3f} | {bits[cand.label]:8.3f} | "
            f"{float((raw < 1).double().mean()):11.3f} | {float(raw.median()):12.3g} | {viol:10d} | "
            f"{float((orc < 1).double().mean()):18.3f}"
        )
    print(
        f"cells per codec: {raw.numel()}; informative/median meter: certified (Tier A, any query); oracle: "
        "empirical ceiling (radius = true |ε| of the measured query)"
    )
    if any(r["violations"] for rs in results.values() for r in rs):
        raise SystemExit("VIOLATIONS FOUND")


if __name__ == "__main__":
    main()
