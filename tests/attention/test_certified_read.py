"""certified_read on synthetic stores: per-cell soundness (TV and output), gate semantics, exact repair."""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import HKV, B, D, G
from attention_cases import exact_fallback as _exact
from attention_cases import setup_read as _setup

from kvcert import kernels
from kvcert.attention import certified
from kvcert.attention.certified import ReadConfig, certified_read
from kvcert.cache.gate import Gate


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "dither-int8", "fp8-e4m3", "sign-1", "kvquant-4"])
@pytest.mark.parametrize("qscale", [0.3, 3.0, 30.0])
def test_every_cell_sound(codec, qscale):
    for seed in range(3):
        st, q, mask = _setup(codec, 96, seed, qscale, nq=2)
        cfg = ReadConfig(Gate.off(), True, 1e-6)
        res = certified_read(q, st, mask, D**-0.5, cfg, _exact(st, q, mask, D**-0.5))
        assert torch.all(res.true_tv <= res.cert_pre), (res.true_tv - res.cert_pre).max()
        assert torch.all(res.true_out_err <= res.out_bound)
        assert torch.all(res.tanh >= 0) and torch.all(res.cert_pre <= 1)
        assert torch.all(res.raw >= res.cert_pre)


def test_head_repair_returns_dense_output_bit_for_bit():
    st, q, mask = _setup("int2", 64, 0, 3.0)
    exact = _exact(st, q, mask, D**-0.5)
    res = certified_read(q, st, mask, D**-0.5, ReadConfig(Gate.certified(0.0), False, 1e-6), exact)
    assert res.repaired.all()
    assert torch.equal(res.out, exact(st.k.host.view(), st.v.host.view()))
    assert res.bytes_paged == B * HKV * st.n * 2 * D * 4


def test_any_of_g_semantics_and_unrepaired_cells_carry_tau():
    st, q, mask = _setup("int4", 64, 1, 3.0)
    tau = 0.1
    res = certified_read(
        q, st, mask, D**-0.5, ReadConfig(Gate.certified(tau), True, 1e-6), _exact(st, q, mask, D**-0.5)
    )
    per_kv = res.cert_pre.reshape(B, HKV, G).amax(-1) > tau
    assert torch.equal(res.repaired, per_kv)
    assert torch.all(res.cert <= tau)


def test_partial_head_repair_recomputes_only_needed_heads_and_matches_dense():
    st, q, mask = _setup("int8", 64, 1, 1.0)
    scale = D**-0.5
    off = certified_read(q, st, mask, scale, ReadConfig(Gate.off(), False, 1e-6), _exact(st, q, mask, scale))
    per_head = off.cert_pre.reshape(B, HKV, G).amax(-1).amax(0).sort().values  # worst row per KV head
    tau = float(per_head[-2:].mean())  # only the riskiest KV head is repaired, in the rows that need it
    asked = []
    exact = _exact(st, q, mask, scale)

    def spy(hk, hv, m, heads=None):
        asked.append(heads)
        return exact(hk, hv, m, heads)

    res = certified_read(q, st, mask, scale, ReadConfig(Gate.certified(tau), True, 1e-6), spy)
    assert res.repaired.any() and not res.repaired.all()
    need = res.repaired.any(0).nonzero().flatten().tolist()
    assert asked == [(need[0], need[-1] + 1)] and need[-1] + 1 - need[0] < HKV
    dense = exact(st.k.host.view(), st.v.host.view())  # [B, Q, Hq, Dv]
    for bi in range(B):
        for hi in range(HKV):
            got, want = res.out[bi, :, hi * G : (hi + 1) * G], dense[bi, :, hi * G : (hi + 1) * G]
            if res.repaired[bi, hi]:
                assert torch.equal(got, want)
            else:
                assert torch.equal(got, off.out[bi, :, hi * G : (hi + 1) * G])
    assert torch.all(res.true_out_err <= res.out_bound)


@pytest.mark.parametrize("backend", ["numba", "torch", "triton"])
def test_box_gate_spares_heads_the_meter_would_repair_and_stays_sound(backend, monkeypatch):
    """``Gate.certified(tau, box=True)``: every cell's exact TV and output error stay within the refined
    certificate and output bound (validate mode), the refined certificate is never above the meter's, the box repairs
    a subset of the meter's heads (strictly fewer over these cases), a spared head is served as is with every cell
    ``<= tau``, and a repaired head still gets the dense output."""
    monkeypatch.setenv(kernels.ENV, backend)
    scale, tau, spared = D**-0.5, 0.1, 0
    for seed in range(3):
        st, q, mask = _setup("int8", 96, seed, 10.0, nq=2)
        exact = _exact(st, q, mask, scale)
        meter = certified_read(q, st, mask, scale, ReadConfig(Gate.certified(tau), True, 1e-6), exact)
        box = certified_read(q, st, mask, scale, ReadConfig(Gate.certified(tau, box=True), True, 1e-6), exact)
        assert torch.all(box.true_tv <= box.cert_pre) and torch.all(box.true_out_err <= box.out_bound)
        assert torch.all(box.cert_pre <= meter.cert_pre) and torch.all(box.raw == meter.raw)
        assert torch.all(box.repaired <= meter.repaired)
        assert torch.equal(box.repaired, box.cert_pre.reshape(B, HKV, -1).amax(-1) > tau)
        kept = (meter.repaired & ~box.repaired).view(B, HKV, 1).expand(B, HKV, G).reshape(B, HKV * G)
        spared += int((meter.repaired & ~box.repaired).sum())
        assert torch.all(box.cert.reshape(B, HKV * G, -1)[kept] <= tau)
        heads = box.repaired.repeat_interleave(G, 1)  # [B, Hq]: the query heads of the repaired KV heads
        assert torch.equal(box.out.transpose(1, 2)[heads], meter.out.transpose(1, 2)[heads])
        assert box.bytes_paged < meter.bytes_paged or not bool((meter.repaired & ~box.repaired).any())
    assert spared > 0


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_box_block_gate_pages_no_more_blocks_than_the_meters_and_stays_sound(backend, monkeypatch):
    """A transient block gate with the box: every cell within its refined certificate and output bound (validate
    mode), every repaired cell ``<= tau``, and per head never more blocks than the meter's block gate (it tries a
    shorter prefix, then the meter's sequence of prefixes), strictly fewer over these cases."""
    monkeypatch.setenv(kernels.ENV, backend)
    scale, saved = D**-0.5, 0
    for codec, qscale, tau in (("int8", 10.0, 0.1), ("fp8-e4m3", 1.0, 0.2), ("int4", 1.0, 0.2)):
        for seed in range(2):
            reads = []
            for box in (False, True):
                st, q, mask = _setup(codec, 256, seed, qscale, nq=2)
                gate = Gate.certified(tau, granularity="block", block_size=16, box=box)
                reads.append(
                    certified_read(q, st, mask, scale, ReadConfig(gate, True, 1e-6), _exact(st, q, mask, scale))
                )
            meter, box = reads
            assert torch.all(box.true_tv <= box.cert_pre) and torch.all(box.true_out_err <= box.out_bound)
            assert torch.all(box.cert <= tau) and torch.all(box.cert_pre <= meter.cert_pre)
            assert torch.all(box.blocks <= meter.blocks)
            saved += int((meter.blocks - box.blocks).sum())
    assert saved > 0


def _tier_b_reads(codec: str, seed: int, qscale: float, cells: int) -> tuple:
    """The same read under the box gate and under the box gate with Tier B (``cells`` per row and layer)."""
    scale, tau, delta = D**-0.5, 0.2, 1e-6
    reads = []
    for gate in (Gate.certified(tau, box=True), Gate.certified(tau, box=True, tier_b=True)):
        st, q, mask = _setup(codec, 96, seed, qscale, nq=2)
        cfg = ReadConfig(gate, True, delta, tier_b_cells=cells)
        reads.append((certified_read(q, st, mask, scale, cfg, _exact(st, q, mask, scale)), st))
    return (*reads, tau)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_tier_b_gate_spares_on_the_partial_bound_and_charges_each_cell(backend, monkeypatch):
    """``Gate.certified(tau, box=True, tier_b=True)`` on dithered keys: the certified reading is the box gate's
    (same ``cert_pre``, same output bound), it repairs a subset of the box gate's heads, exactly the spared ones are
    flagged, their partial bound is ``<= tau`` on every cell, never above the certified one, and holds the exact TV
    (validate mode, queries independent of the dither); each spared head charges its cells above ``tau`` to the
    row's budget in the store; repaired heads are served as under the box gate."""
    monkeypatch.setenv(kernels.ENV, backend)
    spared = 0
    for seed in range(4):
        (box, _), (tb, st), tau = _tier_b_reads("dither-int6", seed, 1.0, 10**9)
        assert torch.equal(tb.cert_pre, box.cert_pre) and torch.all(tb.true_tv <= tb.cert_pre)
        assert torch.all(tb.repaired <= box.repaired)
        assert torch.equal(tb.tier_b_heads, box.repaired & ~tb.repaired)
        on_b = tb.tier_b_heads.repeat_interleave(G, 1).unsqueeze(-1).expand_as(tb.cert_partial)
        assert torch.all(tb.cert_partial[on_b] <= tau) and torch.all(tb.cert_partial <= tb.cert)
        assert torch.all(tb.true_tv[on_b] <= tb.cert_partial[on_b])
        assert torch.equal(tb.cert_partial[~on_b], tb.cert[~on_b])
        relies = ((tb.cert_pre > tau) & on_b).reshape(B, -1).sum(-1)
        assert tb.tier_b_charged.tolist() == relies.tolist() == st.tier_b_spent(B)
        assert torch.all(tb.true_out_err <= tb.out_bound)
        heads = tb.repaired.repeat_interleave(G, 1)
        assert torch.equal(tb.out.transpose(1, 2)[heads], box.out.transpose(1, 2)[heads])
        spared += int(tb.tier_b_heads.sum())
    assert spared > 0


def test_tier_b_gate_box_takes_the_uniform_law_radii(monkeypatch):
    """The gate's third pass takes the uniform-law radii on the heaviest tokens (``docs/math.md#tier-b-uniform``):
    with them it spares every head it spares on the union radii alone (``UNIFORM_TOKENS = 0``), and more; the partial
    bound of every spared head still holds the exact TV."""
    gained = 0
    for seed in range(4):
        (_, _), (uni, _), _ = _tier_b_reads("dither-int6", seed, 1.0, 10**9)
        with monkeypatch.context() as m:
            m.setattr(certified, "UNIFORM_TOKENS", 0)
            (_, _), (union, _), _ = _tier_b_reads("dither-int6", seed, 1.0, 10**9)
        assert torch.all(union.tier_b_heads <= uni.tier_b_heads)
        on_b = uni.tier_b_heads.repeat_interleave(G, 1).unsqueeze(-1).expand_as(uni.cert_partial)
        assert torch.all(uni.true_tv[on_b] <= uni.cert_partial[on_b])
        gained += int((uni.tier_b_heads & ~union.tier_b_heads).sum())
    assert gained > 0


def test_tier_b_gate_fails_closed_on_an_empty_budget_and_plain_keys():
    """With no budget left (``tier_b_cells=0``) a Tier-B gate repairs what the box gate repairs; a head that needs
    more cells than its row has left is repaired (rows are charged apart); keys without a dither pass nothing on
    Tier B."""
    (box, _), (tb, st), _ = _tier_b_reads("dither-int6", 0, 1.0, 0)
    assert box.repaired.any() and torch.equal(tb.repaired, box.repaired)
    assert not tb.tier_b_heads.any() and tb.tier_b_charged.tolist() == [0] * B == st.tier_b_spent(B)
    (_, _), (full, _), _ = _tier_b_reads("dither-int6", 0, 1.0, 10**9)
    first = full.tier_b_charged.tolist()
    assert sum(first) > 0
    (_, _), (some, st), _ = _tier_b_reads("dither-int6", 0, 1.0, min(c for c in first if c > 0) - 1)
    assert all(c < f or f == 0 for c, f in zip(some.tier_b_charged.tolist(), first, strict=True))
    assert torch.all(some.tier_b_heads <= full.tier_b_heads) and max(st.tier_b_spent(B)) < min(c for c in first if c)
    (box8, _), (tb8, _), _ = _tier_b_reads("int4", 0, 3.0, 10**9)
    assert torch.equal(tb8.repaired, box8.repaired) and not tb8.tier_b_heads.any()


def test_tier_b_gate_needs_the_box():
    assert Gate.certified(0.2, box=True, tier_b=True).describe() == "certified(tau=0.2, head, box, tier-b)"
    assert Gate.certified(0.2, value_tol=0.05).describe() == "certified(tau=0.2, head, value_tol=0.05)"
    with pytest.raises(ValueError, match="needs box=True"):
        Gate.certified(0.2, tier_b=True)


def test_box_is_for_certified_gates_only():
    assert Gate.certified(0.2, box=True).describe() == "certified(tau=0.2, head, box)"
    block = Gate.certified(0.2, granularity="block", persistent=True, box=True)
    assert block.describe() == "certified(tau=0.2, block, persistent, box)"
    with pytest.raises(ValueError, match="risk_ranked gate"):
        Gate("risk_ranked", 5.0, box=True)


def test_block_repair_greedy_until_under_tau():
    st, q, mask = _setup("int2", 128, 2, 3.0)
    tau = 0.05
    gate = Gate.certified(tau, granularity="block", block_size=16)
    res = certified_read(q, st, mask, D**-0.5, ReadConfig(gate, True, 1e-6), _exact(st, q, mask, D**-0.5))
    assert torch.all(res.cert <= tau)
    assert (res.blocks > 0).any()
    assert torch.all(res.true_out_err <= res.out_bound)


def test_tier_b_reported_for_dither_only():
    st, q, mask = _setup("dither-int8", 64, 3, 1.0)
    res = certified_read(q, st, mask, D**-0.5, ReadConfig(Gate.off(), False, 1e-4), _exact(st, q, mask, D**-0.5))
    assert res.cert_b is not None and res.cert_b.shape == res.cert_pre.shape
    st2, q2, mask2 = _setup("int8", 64, 3, 1.0)
    res2 = certified_read(q2, st2, mask2, D**-0.5, ReadConfig(Gate.off(), False, 1e-4), _exact(st2, q2, mask2, D**-0.5))
    assert res2.cert_b is None


@pytest.mark.parametrize("nq", [1, 2])
def test_fused_tier_b_is_never_below_the_eager_tier_b_per_cell(nq, monkeypatch):
    """On the numba backend the read's Tier-B meter comes from the fused kernel; with the kernel declining (as on
    a non-finite input) the same served read takes the eager forms: per cell the fused value is never below the
    eager one and at most 1e-9 above it."""
    import kvcert.attention.certified as certified

    monkeypatch.setenv(kernels.ENV, "numba")
    st, q, mask = _setup("dither-int8", 150, 6, 3.0, nq=nq)
    cfg = ReadConfig(Gate.off(), False, 1e-4)
    calls, kernel = [], certified.tier_b_meter
    monkeypatch.setattr(certified, "tier_b_meter", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    fused = certified_read(q, st, mask, D**-0.5, cfg, _exact(st, q, mask, D**-0.5))
    assert calls  # the fused kernel served it
    monkeypatch.setattr(certified, "tier_b_meter", lambda *a, **k: None)
    eager = certified_read(q, st, mask, D**-0.5, cfg, _exact(st, q, mask, D**-0.5))
    assert fused.cert_b is not None and eager.cert_b is not None
    assert torch.equal(fused.cert_pre, eager.cert_pre)
    assert torch.all(fused.cert_b >= eager.cert_b), (eager.cert_b - fused.cert_b).max()
    assert torch.all(fused.cert_b <= eager.cert_b + 1e-9)
    assert (eager.cert_b > 0).any()


def test_value_promotion_zeroes_value_term():
    st, q, mask = _setup("int8", 64, 4, 0.1)
    gate = Gate.certified(1.0, value_tol=0.0)
    res = certified_read(q, st, mask, D**-0.5, ReadConfig(gate, True, 1e-6), _exact(st, q, mask, D**-0.5))
    assert res.values_promoted.all()
    assert torch.all(res.value_term == 0)
    assert torch.all(res.true_out_err <= res.out_bound)


def test_value_promotion_after_a_partial_repair_counts_what_it_pages():
    """A repair changes the terms value promotion decides on, so the read decides promotion again after it: no
    repaired head is promoted, the bytes paged are the repaired heads' K/V plus the promoted heads' V (counted on
    the host from the read-backs), and every cell stays sound."""
    st, q, mask = _setup("int8", 64, 4, 0.1)
    scale = D**-0.5
    off = certified_read(q, st, mask, scale, ReadConfig(Gate.off(), False, 1e-6), _exact(st, q, mask, scale))
    tau = float(off.cert_pre.reshape(B, HKV, G).amax(-1).amax(0).sort().values[-2:].mean())
    gate = Gate.certified(tau, value_tol=0.0)
    res = certified_read(q, st, mask, scale, ReadConfig(gate, True, 1e-6), _exact(st, q, mask, scale))
    assert res.repaired.any() and not res.repaired.all() and res.values_promoted.any()
    assert not (res.repaired & res.values_promoted).any()
    want = (int(res.repaired.sum()) * 2 + int(res.values_promoted.sum())) * st.n * D * 4
    assert res.bytes_paged == want
    assert torch.all(res.true_out_err <= res.out_bound)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's reductions over the NaN
@pytest.mark.parametrize("backend", ["numba", "torch", "triton"])
def test_a_non_finite_query_fails_closed_alike_on_every_backend(backend, monkeypatch):
    """A NaN query entry: the Triton and eager reads do not wait for the device to learn it, read its flag back
    with the gate's decision and serve the read again on the eager fail-closed path (the numba kernel sees it on
    the host). Every backend then serves the same read: the query head's cells report 1 (unclipped ``inf``), its
    KV head is repaired exactly, and none of the checks made on the NaN (the query's band norms, the softmax
    range checks) raises."""
    st, q, mask = _setup("int4", 64, 3, 1.0)
    q[0, 1, 0, 5] = math.nan  # query head 1 reads KV head 0 of row 0
    scale, gate = D**-0.5, Gate.certified(0.5)
    monkeypatch.setenv(kernels.ENV, "numba")
    ref = certified_read(q, st, mask, scale, ReadConfig(gate, False, 1e-6), _exact(st, q, mask, scale))
    monkeypatch.setenv(kernels.ENV, backend)
    res = certified_read(q, st, mask, scale, ReadConfig(gate, False, 1e-6), _exact(st, q, mask, scale))
    assert res.cert_pre[0, 1, 0] == 1 and res.raw[0, 1, 0] == math.inf and res.repaired[0, 0]
    assert torch.equal(res.repaired, ref.repaired) and torch.equal(res.cert, ref.cert)
    assert torch.equal(res.cert_pre >= 1, ref.cert_pre >= 1)
    assert torch.allclose(res.out, ref.out, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_a_failed_check_of_the_read_raises_its_own_error_and_changes_nothing(monkeypatch):
    """The read's range checks wait for its one read-back: a negative radius (planted: a witness below 0) still
    raises the softmax check's own error, before the gate repairs anything, so a persistent repair keeps no
    entry."""
    monkeypatch.setenv(kernels.ENV, "torch")
    st, q, mask = _setup("int4", 64, 3, 1.0)
    st.k_band.view()[0, 0, 3] = -1.0
    gate = Gate.certified(0.0, persistent=True)  # would repair and keep every head
    with pytest.raises(ValueError, match="radius must be finite and non-negative"):
        certified_read(q, st, mask, D**-0.5, ReadConfig(gate, False, 1e-6), _exact(st, q, mask, D**-0.5))
    assert not st.held_heads().any()


@pytest.mark.parametrize("codec", ["int8", "int2", "dither-int8"])
def test_decode_kernels_agree_with_the_eager_read_path(codec, monkeypatch):
    """The fused decode kernels (CPU, few query rows) and the eager reference serve the same read: meter,
    output, value term and output bound agree up to float32 effects (the eager radii round through float32,
    the logits and outputs differ in summation order); both are sound in every cell."""
    import kvcert.attention.certified as certified

    st, q, mask = _setup(codec, 150, 4, 3.0, nq=2)
    cfg = ReadConfig(Gate.off(), True, 1e-6)
    fused = certified_read(q, st, mask, D**-0.5, cfg, _exact(st, q, mask, D**-0.5))
    monkeypatch.setattr(certified, "DECODE_MAX_ROWS", 0)
    eager = certified_read(q, st, mask, D**-0.5, cfg, _exact(st, q, mask, D**-0.5))
    informative = eager.raw <= 10
    # the eager radii round through float32 (inflated by (nb + 2)·2^-23), the kernels stay in float64
    assert torch.allclose(fused.raw[informative], eager.raw[informative], rtol=2e-5, atol=1e-9)
    assert torch.equal(fused.cert_pre >= 1, eager.cert_pre >= 1)
    assert torch.allclose(fused.out, eager.out, rtol=1e-4, atol=1e-5)
    assert torch.allclose(fused.out_bound, eager.out_bound, rtol=1e-5)
    assert torch.allclose(fused.value_term, eager.value_term, rtol=1e-5)
    for res in (fused, eager):
        assert torch.all(res.true_tv <= res.cert_pre) and torch.all(res.true_out_err <= res.out_bound)


@pytest.mark.parametrize("codec", ["int8", "int2"])
def test_kernel_output_bound_is_the_eager_formula_per_cell(codec):
    """The decode kernel forms the unrepaired output bound itself; on its own inputs it equals ``_out_bound``
    (same float64 operations; ``tanh`` may differ by an ulp between libm and torch)."""
    import kvcert.attention.certified as certified

    st, q, mask = _setup(codec, 150, 5, 3.0, nq=2)
    hkv = st.k.served.view().shape[1]
    qg = certified.group_heads(q.to(torch.float32), hkv)
    sv = certified._fused_served(qg, st, mask, 2, D**-0.5)
    assert sv is not None
    bound, key_term, slack = certified._out_bound(
        sv.value_term, sv.cert, sv.spread, sv.vmax, st.n, sv.out.shape[-1], sv.phi_max
    )
    for got, want in ((sv.bound, bound), (sv.key_term, key_term), (sv.slack, slack)):
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=1e-14, atol=0), (got - want).abs().max()
    assert torch.equal(sv.key_term, key_term)  # no transcendental in the key term: bit for bit
