"""Pooling telemetry over samples: cell-weighted fractions equal the all-cells fraction; maps per cell."""

from __future__ import annotations

import math

import torch

from kvcert.cache.telemetry import Telemetry
from kvcert.report import aggregate


def telemetry(cert: torch.Tensor, raw: torch.Tensor, stored: int = 40, fp16: int = 160) -> Telemetry:
    steps, layers, b, hq = cert.shape
    return Telemetry(
        certificates=cert,
        raw=raw,
        served=cert,
        tanh=cert,
        out_bound=cert,
        tier_b=None,
        true_tv=None,
        true_out_err=None,
        repaired=torch.zeros(steps, layers, b, hq // 2, dtype=torch.bool),
        group_size=2,
        violations=0,
        out_violations=0,
        bytes_stored=stored,
        bytes_fp16=fp16,
        bytes_paged=0,
        bytes_host=0,
        bytes_witness=0,
        head_dim=8,
        nonfinite=0,
        fail_closed=0,
        tier_b_delta=None,
        gate="off",
    )


def test_pooled_coverage_equals_all_cells_at_once() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(3, 2, 1, 4, generator=gen)
    b = torch.rand(5, 2, 1, 4, generator=gen)
    b[0, 0] = float("nan")  # an unrecorded cell must not count
    tels = [telemetry(a, a * 3), telemetry(b, b * 3)]
    pooled = aggregate.pooled(tels, lambda t: t.coverage(0.3, "q_head"))
    cells = aggregate.cells(tels, "certificates")
    assert cells.numel() == 3 * 8 + 5 * 8 - 4
    assert math.isclose(pooled, float((cells <= 0.3).double().mean()), rel_tol=1e-12)


def test_layer_head_maps_match_manual_means() -> None:
    cert = torch.tensor([[[[0.1, 0.9]], [[0.5, float("nan")]]], [[[0.3, 0.7]], [[0.4, 0.2]]]])  # [2, 2, 1, 2]
    raw = cert * 2
    t = telemetry(cert, raw)
    m = aggregate.certificate_map([t, t])
    assert torch.allclose(m, torch.tensor([[0.2, 0.8], [0.45, 0.2]], dtype=torch.float64))
    s = aggregate.saturation_map([t])
    assert torch.allclose(s, torch.tensor([[0.0, 1.0], [0.5, 0.0]], dtype=torch.float64))


def test_bytes_per_token_and_stored_fraction() -> None:
    t = telemetry(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4), stored=30, fp16=120)
    # K and V, 2 bytes, 3 layers, Hkv = 4 / group 2 = 2, head_dim 8
    assert aggregate.fp16_bytes_per_token(t) == 2 * 2 * 3 * 2 * 8
    assert aggregate.stored_fraction([t, telemetry(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4), 10, 40)]) == 0.25
