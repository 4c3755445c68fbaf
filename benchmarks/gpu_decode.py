"""GPU decode read of one attention layer: dense SDPA vs kvcert raw / certified / gated, side by side in one run.

Question: what does the certificate cost on a GPU (certified / raw) and what does a gated certified read cost
against a dense FlashAttention decode (gated / dense), at contexts 4k–128k and batch 1–32?

One decode step (one query per row) of one layer, ``Hq`` query heads over ``Hkv`` KV heads of dimension ``D``:

* ``dense``     — ``torch.nn.functional.scaled_dot_product_attention`` over exact bfloat16 K/V (FlashAttention
  backend where torch picks it);
* ``raw``       — the same SDPA call over the store's served float32 K/V (the codec's dequantized scratch), no
  certificate: what kvcert serves without certifying;
* ``certified`` — :func:`kvcert.attention.certified.certified_read` with the gate off, on the backend
  :func:`kvcert.kernels.active` picks (Triton on CUDA): served read + every cell's certificate + output bound;
* ``gated``     — the same with ``Gate.certified(tau)`` (head repair from the pinned host tier).

The Triton read dequantizes the store's packed codes in registers (``kvcert.kernels.packed``); ``raw`` reads the
float32 scratch through SDPA, so ``certified / raw`` compares a read of the codes with a read of float32 K/V.
Before timing, a correctness check compares the Triton read over the codes with the one over the scratch (bit
for bit), then with the eager reference forms on the device
(every cell, within the stated allowances) and the device's float64 ``exp`` with the CPU's (the kernels assume
1 ulp). Each variant is timed as the median of ``--reps`` runs after warm-up (CUDA events on a GPU); peak
device memory per variant and the store's bytes are recorded. Tier: **empirical** (timings, memory); the
certificates themselves are the certified tier. Results go to ``--out`` (JSON), written after every
configuration so a run cut short keeps what it measured.

``--smoke`` runs tiny sizes on CPU (Triton interpreter) to check the script end to end.

    python benchmarks/gpu_decode.py --out gpu_decode.json          # on a CUDA machine (benchmarks/device/run.sh)
    TRITON_INTERPRET=1 python benchmarks/gpu_decode.py --smoke --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time

import torch

from kvcert import Gate, kernels, quant
from kvcert.attention.certified import ReadConfig, certified_read, group_heads
from kvcert.attention.exact import ExactAttention
from kvcert.cache.store import LayerStore


def _timer(device: torch.device, fn, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _peak(device: torch.device, fn) -> int | None:
    """Peak device bytes allocated while ``fn()`` runs (CUDA only)."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def _store(
    b: int, hkv: int, s: int, d: int, codec: str, device: torch.device, gen: torch.Generator
) -> tuple[LayerStore, torch.Tensor, torch.Tensor]:
    """A layer store holding ``s`` random tokens encoded by ``codec`` (the last write_block may stay pending),
    and the exact bfloat16 K/V on the device."""
    store = LayerStore(0, quant.get(codec), quant.get(codec), bands=8, pairing="rotate_half", seed=0, write_block=16)
    k = torch.randn(b, hkv, s, d, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    v = torch.randn(b, hkv, s, d, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    rows, keep = torch.arange(1, b + 1, device=device), torch.zeros(b, dtype=torch.bool, device=device)
    step = max(16, s // 8)
    for t0 in range(0, s, step):  # chunked writes keep the encoder's temporaries small
        store.append(k[:, :, t0 : t0 + step], v[:, :, t0 : t0 + step], rows, keep)
    store.encode_pending()
    return store, k, v


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _exact_attention(q: torch.Tensor, hkv: int) -> ExactAttention:
    """The exact attention a head repair serves: SDPA over host-tier K/V paged in to the query's device (every
    token is visible in this benchmark's reads, so the mask is all True and not applied)."""
    g = q.shape[1] // hkv

    def exact_attention(
        hk: torch.Tensor, hv: torch.Tensor, mask: torch.Tensor, heads: tuple[int, int] | None = None
    ) -> torch.Tensor:
        h0, h1 = heads if heads is not None else (0, hkv)
        kk, vv = (x[:, h0:h1].to(q.device, torch.float32, non_blocking=True) for x in (hk, hv))
        return _sdpa(q[:, h0 * g : h1 * g], kk, vv).transpose(1, 2)

    return exact_attention


def _exp_ulps(device: torch.device) -> float:
    """Largest distance, in units of the CPU value's last place, between the Triton kernels' float64 ``exp``
    (``tl.exp``, as the read's kernels call it) on ``device`` and the CPU's ``exp``."""
    import triton
    import triton.language as tl

    @triton.jit
    def _exp64(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.exp(tl.load(x_ptr + i, mask=i < n, other=0.0)), mask=i < n)

    x = torch.cat(
        [
            torch.linspace(-700, 700, 200_001, dtype=torch.float64),
            torch.randn(100_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 50,
        ]
    )
    xd = x.to(device)
    y = torch.empty_like(xd)
    _exp64[(triton.cdiv(x.numel(), 1024),)](xd, y, x.numel(), BLOCK=1024)
    ref = x.exp()
    ulp = torch.nextafter(ref, torch.tensor(math.inf, dtype=torch.float64)) - ref
    return float(((y.cpu() - ref).abs() / ulp).max())


def check(device: torch.device, gen: torch.Generator) -> dict:
    """On this device: the Triton read against the eager reference forms per cell, its float64 ``exp``, and the
    certified read end to end (validate mode; head repair at tau = 0; block repair under a threshold)."""
    from kvcert.attention.certified import masked_logits, probs64, served_meter
    from kvcert.bounds import true_tv
    from kvcert.kernels import triton_read
    from kvcert.kernels.packed import code_tiles

    b, hq, hkv, d, s = 2, 8, 2, 64, 1000
    store, _, _ = _store(b, hkv, s, d, "int4", device, gen)
    q = torch.randn(b, hq, 1, d, generator=gen, device=device) * 2
    qg = group_heads(q, hkv)
    scratch = triton_read.read_store(qg, store, None, 1, d**-0.5, splits=4, packed=False)
    tr = triton_read.read_store(qg, store, None, 1, d**-0.5, splits=4)
    k_tiles, v_tiles = code_tiles(store)
    assert tr is not None and scratch is not None
    p_ref = probs64(tr.logits)
    cert_ref, raw_ref = served_meter(p_ref, tr.c)
    full = torch.ones(1, dtype=torch.bool, device=device)
    exact = masked_logits(qg, store.k.host.view().to(device, torch.float32), full, d**-0.5, True)
    tv = true_tv(probs64(exact), tr.p64)
    result: dict = {
        "packed_modes": [k_tiles.mode, v_tiles.mode],
        "packed_equals_scratch": all(
            torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(tr, scratch, strict=True)
        ),
        "p_max_rel_diff": float(((tr.p64 - p_ref).abs() / p_ref.clamp(min=1e-300)).max()),
        "raw_minus_reference_min": float((tr.raw - raw_ref).min()),
        "raw_minus_reference_max": float((tr.raw - raw_ref).max()),
        "cells": int(tv.numel()),
        "violations": int((tv > tr.cert + 1e-12).sum()),
        "triton_exp64_max_ulps": _exp_ulps(device),
    }
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool, device=device)
    exact_attention = _exact_attention(q, hkv)
    for name, gate in (
        ("head_tau0", Gate.certified(0.0)),
        ("block_tau0.05", Gate.certified(0.05, granularity="block", block_size=64)),
    ):
        cfg = ReadConfig(gate=gate, validate=True, delta_loc=1e-6, attn_kv=True)
        res = certified_read(q, store, mask, d**-0.5, cfg, exact_attention)
        result[f"{name}_violations"] = int(
            (res.true_tv > res.cert_pre + 1e-12).sum() + (res.true_out_err > res.out_bound).sum()
        )
        result[f"{name}_max_served_cert"] = float(res.cert.max())
    ok = (
        result["packed_equals_scratch"]
        and 0 not in result["packed_modes"]
        and result["violations"] == 0
        and result["p_max_rel_diff"] < 1e-10
        and result["triton_exp64_max_ulps"] <= 2
        and -1e-12 <= result["raw_minus_reference_min"]
        and result["raw_minus_reference_max"] <= 1e-9
        and result["head_tau0_violations"] == 0
        and result["head_tau0_max_served_cert"] == 0.0
        and result["block_tau0.05_violations"] == 0
        and result["block_tau0.05_max_served_cert"] <= 0.05
    )
    result["ok"] = ok
    return result


def bench(b: int, s: int, args: argparse.Namespace, device: torch.device, gen: torch.Generator) -> dict:
    hq, hkv, d = args.hq, args.hkv, args.d
    store, k, v = _store(b, hkv, s, d, args.codec, device, gen)
    q = torch.randn(b, hq, 1, d, generator=gen, device=device)
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool, device=device)
    scaling = d**-0.5
    exact_attention = _exact_attention(q, hkv)
    served_k, served_v = store.k.served.view(), store.v.served.view()
    qb = q.to(torch.bfloat16)
    off = ReadConfig(gate=Gate.off(), validate=False, delta_loc=1e-6, attn_kv=False)
    gated = ReadConfig(gate=Gate.certified(args.tau), validate=False, delta_loc=1e-6, attn_kv=False)
    variants = {
        "dense": lambda: _sdpa(qb, k, v),
        "raw": lambda: _sdpa(q, served_k, served_v),
        "certified": lambda: certified_read(q, store, mask, scaling, off, exact_attention),
        "gated": lambda: certified_read(q, store, mask, scaling, gated, exact_attention),
    }
    row: dict = {"batch": b, "context": s, "ms": {}, "peak_bytes": {}}
    for name, fn in variants.items():
        row["peak_bytes"][name] = _peak(device, fn)
        row["ms"][name] = _timer(device, fn, args.reps)
    res = certified_read(q, store, mask, scaling, gated, exact_attention)
    row["gated_repaired_heads"] = int(res.repaired.sum())
    row["gated_max_served_cert"] = float(res.cert.max())
    row["certified_over_raw"] = row["ms"]["certified"] / row["ms"]["raw"]
    row["gated_over_dense"] = row["ms"]["gated"] / row["ms"]["dense"]
    row["bytes_stored"] = store.bytes_stored()
    row["bytes_witness"] = store.bytes_witness()
    row["bytes_fp16"] = store.bytes_fp16()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=1 << 20, help="skip configurations with batch·context above")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--codec", default="int4")
    ap.add_argument("--tau", type=float, default=0.2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under the Triton interpreter")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("KVCERT_KERNEL", "triton")
        args.contexts, args.batches, args.hq, args.hkv, args.d, args.reps = "96,200", "1,2", 4, 2, 32, 1
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_decode.py measures a CUDA device; use --smoke on CPU")
        device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    report: dict = {
        "command": "python benchmarks/gpu_decode.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else (f"--{k}" if v else "")
            for k, v in vars(args).items()
        ).strip(),
        "tier": "empirical (timings, memory); certificates: certified",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "backend": kernels.active(device),
        "shape": {"hq": args.hq, "hkv": args.hkv, "d": args.d, "codec": args.codec, "tau": args.tau},
        "check": check(device, gen),
        "rows": [],
    }
    print(json.dumps(report["check"]))
    if not report["check"]["ok"]:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        raise SystemExit("correctness check failed; no timings taken")
    for s in (int(x) for x in args.contexts.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            if b * s > args.max_tokens:
                continue
            row = bench(b, s, args, device, gen)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the configuration's store and K/V are gone
            report["rows"].append(row)
            print(
                f"S={s:>6} B={b:>2}  "
                + "  ".join(f"{k} {v:8.3f} ms" for k, v in row["ms"].items())
                + f"  certified/raw {row['certified_over_raw']:.2f}  gated/dense {row['gated_over_dense']:.2f}"
                " (empirical)",
                flush=True,
            )
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    if not math.isfinite(sum(r["certified_over_raw"] for r in report["rows"])):
        raise SystemExit("a ratio is not finite")


if __name__ == "__main__":
    main()
