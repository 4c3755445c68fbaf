"""The query-subspace witness ``qsw-int{8,4}`` (``kvcert.quant.query_subspace``): calibration, stored bytes, the
stored bounds per token, per-cell soundness end to end (CI fuzz), and fail-closed input handling."""

from __future__ import annotations

import pytest
import torch
from benchmark_scripts import load_benchmark
from codec_cells import CODEC_PLAN, QSW_FORMS, make_qsw_cells, violations

from kvcert.models.tiny import SUPPORTED_FAMILIES, tiny_random
from kvcert.quant import QuerySubspaceWitness, calibrate_basis, get

F64 = torch.float64


def keys(seed: int = 0, b: int = 2, h: int = 3, t: int = 40, d: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``x`` and what ``hadamard-int4`` serves for them."""
    x = torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(seed))
    codec = get("hadamard-int4")
    return x, codec.decode(codec.encode(x))


def basis(h: int = 3, d: int = 64, k: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(h, d, k, generator=torch.Generator().manual_seed(seed))).Q


def test_calibration_finds_the_query_subspace():
    """Queries spread over four coordinates (and a little noise elsewhere): the rank-4 basis spans those coordinates,
    with orthonormal columns."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2000, 32, generator=gen) * 0.01
    q[..., :4] += torch.randn(2, 2000, 4, generator=gen) * torch.tensor([5.0, 4.0, 3.0, 2.0])
    u = calibrate_basis(q, 4).to(F64)
    assert u.shape == (2, 32, 4)
    torch.testing.assert_close(u.transpose(-1, -2) @ u, torch.eye(4, dtype=F64).expand(2, 4, 4), atol=1e-6, rtol=0)
    assert float(u[:, 4:].norm(dim=1).max()) < 1e-2  # the span is the first four coordinates


@pytest.mark.parametrize("bits", [8, 4])
def test_bytes_are_the_stored_tensors(bits):
    """Per token and KV head: ``k·bits/8`` code bytes + three fp16 values (scale, η, ρ), measured from the tensors."""
    x, x_hat = keys()
    w = QuerySubspaceWitness(basis(), bits)
    packed = w.encode(x, x_hat)
    assert packed.nbytes == sum(t.numel() * t.element_size() for t in packed.tensors.values())
    assert packed.nbytes == 2 * 3 * 40 * (16 * bits // 8 + 6)
    assert w.basis_bytes == 3 * 64 * 16 * 4
    assert w.name == f"qsw-int{bits}"


@pytest.mark.parametrize("bits", [8, 4])
def test_stored_bounds_hold_per_token(bits):
    """``η ≥ ‖ŵ − UᵀΔ‖`` and ``ρ ≥ ‖Δ − UUᵀΔ‖`` for every token, recomputed in float64 from the exact keys; and the
    codes are no looser than the RTN half step (``η ≤ ½·scale·√k``)."""
    x, x_hat = keys(seed=4)
    u = basis(seed=5)
    w = QuerySubspaceWitness(u, bits)
    w_hat, eta, rho = w.decode(w.encode(x, x_hat))
    delta = x_hat.to(F64) - x.to(F64)
    exact = delta @ u.to(F64)
    assert bool((torch.linalg.vector_norm(w_hat - exact, dim=-1) <= eta).all())
    assert bool((torch.linalg.vector_norm(delta - exact @ u.to(F64).transpose(-1, -2), dim=-1) <= rho).all())
    step = w.encode(x, x_hat).tensors["scales"].to(F64).squeeze(-1)
    assert bool((eta <= 0.5 * step * 4.0 * (1 + 1e-3)).all())  # √16 = 4


@pytest.mark.parametrize("codec,bits", QSW_FORMS)
def test_qsw_forms_sound_in_every_cell_of_the_ci_fuzz(codec, bits):
    """>= 2·10^5 adversarial end-to-end cells per form: radius ≥ |ε_t| per token, meter ≥ TV per cell; the aimed
    queries reach the equality case of the last term (the fuzz is adversarial)."""
    gen = torch.Generator().manual_seed(16 + bits)
    n_cells, tight = 0, 0.0
    for _ in range(2):
        for s, rows in CODEC_PLAN:
            cells = make_qsw_cells(codec, bits, rows, s, gen)
            assert violations(cells) == (0, 0), (codec, bits, s)
            n_cells += rows
            tight = max(tight, float((cells.eps.abs() / cells.radius.clamp(min=1e-300)).max()))
    assert n_cells >= 200_000
    assert tight > 0.999


def test_a_residual_beyond_fp16_fails_closed():
    """A residual orthogonal to the span with norm beyond fp16: ``ρ`` is stored as ``+inf`` and the radius of a
    query with a component outside the span is infinite (the read cannot certify that token)."""
    u = torch.zeros(1, 4, 1)
    u[0, 0, 0] = 1.0
    x = torch.zeros(1, 1, 2, 4)
    x_hat = x.clone()
    x_hat[0, 0, 1, 1] = 1e5
    w = QuerySubspaceWitness(u)
    packed = w.encode(x, x_hat)
    assert torch.isinf(packed.tensors["rho"][0, 0, 1]) and packed.tensors["rho"][0, 0, 0] == 0
    radius = w.radius(packed, torch.tensor([[[[0.0, 1.0, 0.0, 0.0]]]]))
    assert torch.isinf(radius[0, 0, 0, 1]) and radius[0, 0, 0, 0] == 0


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: calibrate_basis(torch.ones(2, 3), 1), r"\[H, N, D\]"),
        (lambda: calibrate_basis(torch.ones(1, 3, 4), 5), "rank must be"),
        (lambda: calibrate_basis(torch.full((1, 3, 4), float("nan")), 2), "non-finite"),
        (lambda: QuerySubspaceWitness(torch.ones(2, 4)), r"\[H, D, k\]"),
        (lambda: QuerySubspaceWitness(torch.ones(1, 4, 5)), "rank k=5"),
        (lambda: QuerySubspaceWitness(torch.full((1, 4, 2), float("inf"))), "non-finite"),
        (lambda: QuerySubspaceWitness(torch.ones(1, 4, 2), bits=2), "bits must be"),
        (lambda: QuerySubspaceWitness(torch.ones(1, 4, 3), bits=4), "rank must be even"),
    ],
)
def test_bad_construction_is_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_keys_are_refused_by_name():
    x, x_hat = keys()
    w = QuerySubspaceWitness(basis())
    with pytest.raises(ValueError, match=r"H=2, T, D=64\] for this basis, got \(2, 3"):
        QuerySubspaceWitness(basis(h=2)).encode(x, x_hat)
    with pytest.raises(ValueError, match="non-finite"):
        w.encode(x, x_hat.masked_fill(x_hat > 2.5, float("nan")))
    with pytest.raises(ValueError, match="same shape"):
        w.encode(x, x_hat[:1])
    with pytest.raises(ValueError, match="written by"):
        QuerySubspaceWitness(basis(), 4).decode(w.encode(x, x_hat))
    with pytest.raises(ValueError, match=r"q must be \[B=2, H=3, Q, D=64\]"):
        w.radius(w.encode(x, x_hat), torch.ones(2, 1, 5, 64))


def test_witness_benchmark_measures_the_stored_witness():
    """``benchmarks/witness_tightness.py`` on random post-RoPE queries and keys: every qsw row has 0 violations, its
    bits are the stored tensors' (``k·b/8 + 6`` bytes per token-head), and a sliding-window layer reads its window."""
    bench = load_benchmark("witness_tightness")
    gen = torch.Generator().manual_seed(7)
    qs = [torch.randn(4, 96, 64, generator=gen, dtype=F64) for _ in range(2)]
    ks = [torch.randn(2, 96, 64, generator=gen, dtype=F64) * 2 for _ in range(2)]
    seen = bench.Captured(qs, ks, 0.125, [None, 40])
    rows = [c for c in bench.candidates(64) if c.qsw_rank]
    assert [(c.qsw_rank, c.qsw_bits) for c in rows] == [(16, 8), (32, 4), (32, 8), (48, 8)]
    sub = bench.subspaces(seen, 48)
    for cand in rows:
        r = bench.measure(cand, seen, 3, sub)
        assert r["violations"] == 0
        assert r["witness_bits"] == (cand.qsw_rank * cand.qsw_bits / 8 + 6) * 8 / 64
        assert r["raw"].shape == (2 * 4 * 3,)
    reads = list(bench.head_reads(seen, 3, lambda k: k))
    assert all(bool((r.vis.sum(-1) == 40).all()) for r in reads if r.layer == 1)
    assert all(torch.equal(r.vis.sum(-1), torch.tensor([[94, 95, 96]])) for r in reads if r.layer == 0)


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_witness_is_sound_on_the_reads_of_every_tiny_family(family):
    """The stored witness over real forwards of each tiny family (random weights; calibrated on another sequence):
    every qsw row of the benchmark has 0 radius violations on every (layer, query head, read, token), and the
    sliding-window layers of Gemma-3 read their window."""
    bench = load_benchmark("witness_tightness")
    model = tiny_random(family)
    gen = torch.Generator().manual_seed(3)
    calib, ids = (torch.randint(0, model.config.vocab_size, (1, 48), generator=gen) for _ in range(2))
    seen = bench.capture(model, ids)
    d = seen.qs[0].shape[-1]
    rows = [c for c in bench.candidates(d) if c.qsw_rank]
    sub = bench.subspaces(bench.capture(model, calib), max(c.qsw_rank for c in rows))
    for cand in rows:
        r = bench.measure(cand, seen, 6, sub)
        assert r["violations"] == 0, cand.label
        assert r["raw"].numel() == len(seen.qs) * seen.qs[0].shape[0] * 6
    if family == "gemma3":
        assert seen.windows == [8, 8, None]
