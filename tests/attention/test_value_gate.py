"""The value gate (``Gate.certified(tau, value_rel=ν)``, ``kvcert.attention.value_gate``): every cell is served with
its value term under ``ν`` times its head's value spread, by value upgrades over a token-tier store or exact values
elsewhere; per cell the output bound still holds against exact attention, and the traffic and bytes are measured."""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import HKV, B, D, G
from attention_cases import exact_fallback as _exact

from kvcert.attention.certified import ReadConfig, certified_read
from kvcert.attention.value_gate import ServedValues, gate_values
from kvcert.cache.gate import Gate
from kvcert.cache.store import LayerStore
from kvcert.quant import get, kernel_env

S, NQ = 96, 1
SC = D**-0.5


def _store(seed: int, upgrade: bool = True, **kw) -> tuple[LayerStore, torch.Tensor, torch.Tensor]:
    """A token-tier store (light ``dither-int5`` / ``int2``, heavy and upgrade ``dither-int8`` / ``int4``, a quarter
    of each head heavy) or, without ``upgrade``, a plain ``dither-int5`` / ``int2`` one; queries that concentrate
    their attention on a few tokens; a causal mask with left padding on row 1."""
    g = torch.Generator().manual_seed(seed)
    extra = {"upgrade": (get("dither-int8"), get("int4")), "token_tiers": True} if upgrade else {}
    st = LayerStore(0, get("dither-int5"), get("int2"), bands=2, pairing="rotate_half", seed=seed, **extra, **kw)
    k = torch.randn(B, HKV, S, D, generator=g)
    v = torch.randn(B, HKV, S, D, generator=g) * (1 + 3 * torch.rand(B, HKV, S, 1, generator=g))
    rows, keep = torch.arange(B), torch.zeros(B, dtype=torch.bool)
    st.append(k, v, rows, keep)
    if upgrade:
        st.choose_heavy(
            torch.stack([torch.randperm(S, generator=g)[: S // 4].sort().values for _ in range(B * HKV)]).view(
                B, HKV, -1
            )
        )
    st.append(torch.randn(B, HKV, NQ, D, generator=g), torch.randn(B, HKV, NQ, D, generator=g), rows, keep)
    # each query head aims at a few keys of its KV head: a concentrated read, where a light value's error shows
    aim = k[:, :, torch.randint(0, S, (3,), generator=g)].sum(2)  # [B, HKV, D]
    q = (aim.repeat_interleave(G, 1) + 0.3 * torch.randn(B, HKV * G, D, generator=g)).unsqueeze(2) * 0.6
    n = st.n
    mask = torch.ones(B, 1, NQ, n, dtype=torch.bool)
    mask[1, :, :, : S // 4] = False
    return st, q, mask


def _spread(st: LayerStore, mask: torch.Tensor) -> torch.Tensor:
    """``[B, HKV]`` ``max_t (‖v̂_t − c‖ + ‖Δv_t‖)`` over the visible tokens, from the store's witnesses before the
    read (what the gate's tolerance multiplies)."""
    dist = st.v_dist.view().to(torch.float64) + st.v_res.view().to(torch.float64)
    return torch.where(mask.any(-2), dist, 0.0).amax(-1)


def _assert_slack_covers_the_served_values(st: LayerStore, res) -> None:
    """Per cell, the output bound's float32 slack (bound − key term − value term) is at least ``2(S + D)u`` times the
    largest norm of the values the head serves: after a persistent read the store's served values are the upgraded
    ones it served, whose norms may exceed the light witnesses' bound (an exact value's never does)."""
    slack = (res.out_bound - res.key_term - res.value_term).view(B, HKV, G)
    served = st.v.served.view().to(torch.float64).norm(dim=-1).amax(-1)  # [B, HKV]
    floor = 2.0 * (st.n + D) * 2.0**-24 * served
    assert bool((slack >= floor.unsqueeze(-1) * (1 - 1e-9)).all()), float((floor.unsqueeze(-1) - slack).max())


def _read(st, q, mask, gate, validate=True):
    return certified_read(q, st, mask, SC, ReadConfig(gate, validate, 1e-6), _exact(st, q, mask, SC))


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("nu", [0.0, 0.02, 0.06])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_cell_is_served_under_its_tolerance_and_its_output_bound_holds(
    backend, nu, persistent, seed, monkeypatch
):
    monkeypatch.setenv(kernel_env.ENV, backend)
    st, q, mask = _store(seed)
    spread = _spread(st, mask).repeat_interleave(G, 1).unsqueeze(-1)  # [B, Hq, 1]
    off = _read(st, q, mask, Gate.certified(1.0, granularity="block", block_size=1, persistent=persistent))
    assert bool((off.value_term > nu * spread).any())  # the gate has something to do
    gate = Gate.certified(1.0, granularity="block", block_size=1, persistent=persistent, value_rel=nu)
    light_before = [[int(st.light(b, h, is_key=False).sum()) for h in range(HKV)] for b in range(B)]
    res = _read(st, q, mask, gate)
    # per cell: under the tolerance, and the bound of what was served covers its true error
    assert bool((res.value_term <= nu * spread * (1 + 1e-12)).all())
    assert bool((res.true_out_err <= res.out_bound).all()), float((res.true_out_err - res.out_bound).max())
    assert bool((res.values_upgraded | res.values_promoted).any()) and res.bytes_paged > 0
    if nu == 0.0:  # int4 values still err: only exact values reach 0
        assert bool(res.values_promoted[(off.value_term > 0).view(B, HKV, G).any(-1)].all())
    for b in range(B):
        for h in range(HKV):
            light = int(st.light(b, h, is_key=False).sum())
            kept = persistent and bool(res.values_upgraded[b, h])
            assert (light < light_before[b][h]) if kept else (light == light_before[b][h])
    if persistent:
        _assert_slack_covers_the_served_values(st, res)
    if persistent:  # later reads serve the kept upgrades (and may upgrade more: the stored witnesses round up)
        spread = _spread(st, mask).repeat_interleave(G, 1).unsqueeze(-1)  # smaller: upgraded values err less
        again = _read(st, q, mask, gate)
        assert bool((again.value_term <= nu * spread * (1 + 1e-12)).all())
        assert bool((again.true_out_err <= again.out_bound).all())


def test_the_gates_vmax_bounds_the_norm_of_every_upgraded_value_it_serves():
    """``ValueRepairs.vmax`` enters the output bound's slack, which must cover every value the head sums: given 0 for
    the read's own bound, it comes back at least the norm of each value the gate upgraded (kept, then read back)."""
    st, _, _ = _store(8)
    g = torch.Generator().manual_seed(8)
    p = torch.softmax(torch.randn(1, G, st.n, generator=g, dtype=torch.float64) * 4, -1)
    served = ServedValues(
        p, st.v.served.view()[:1, 0].to(torch.float32), st.v_res.view()[:1, 0], torch.zeros(1, st.n, dtype=torch.bool)
    )
    tol = 0.5 * (p[0] @ st.v_res.view()[0, 0].to(torch.float64)).amin().reshape(1)  # every cell above it
    res = gate_values(st, [(0, 0)], served, tol, torch.zeros(1, dtype=torch.float64), persistent=True)
    assert res.upgraded > 0 and res.upgraded_heads == [True]
    slots = torch.cat([u.slots - st.base for u in st.v.upgrades])
    norms = st.v.served.view()[0, 0, slots].to(torch.float64).norm(dim=-1)
    assert float(res.vmax[0]) >= float(norms.max()) * (1 - 1e-7)


def test_a_head_under_its_tolerance_is_served_as_without_the_gate():
    st, q, mask = _store(3)
    base = _read(st, q, mask, Gate.certified(1.0, granularity="block", block_size=1))
    loose = _read(st, q, mask, Gate.certified(1.0, granularity="block", block_size=1, value_rel=1e9))
    assert not bool(loose.values_upgraded.any() | loose.values_promoted.any())
    assert torch.equal(base.out, loose.out) and torch.equal(base.out_bound, loose.out_bound)
    assert base.bytes_paged == loose.bytes_paged == 0


def test_a_tighter_tolerance_repairs_more_values():
    """Values are repaired in order of ``max_cells p̃_t‖Δv_t‖`` from the shortest prefix that could pass, doubling:
    a loose tolerance upgrades a few values per flagged head, a tighter one repairs more, on the same read."""
    counts = []
    for nu in (0.12, 0.08, 0.05):
        st, q, mask = _store(4)
        res = _read(st, q, mask, Gate.certified(1.0, granularity="block", block_size=1, persistent=True, value_rel=nu))
        counts.append(st.upgraded + res.bytes_paged)
    assert counts == sorted(counts) and counts[0] < counts[-1]
    st, q, mask = _store(4)
    res = _read(st, q, mask, Gate.certified(1.0, granularity="block", block_size=1, persistent=True, value_rel=0.12))
    assert bool(res.values_upgraded.all()) and st.upgraded <= 4 * 4  # a few per head


def test_without_upgrade_codecs_a_flagged_head_is_served_exact_values():
    st, q, mask = _store(5, upgrade=False)
    spread = _spread(st, mask).repeat_interleave(G, 1).unsqueeze(-1)
    res = _read(st, q, mask, Gate.certified(1.0, granularity="block", block_size=1, value_rel=0.02))
    flagged = res.values_promoted
    assert bool(flagged.any()) and not bool(res.values_upgraded.any())
    assert bool((res.value_term <= 0.02 * spread * (1 + 1e-12)).all())
    row = D * st.v.host.dtype.itemsize  # one exact value
    assert res.bytes_paged % row == 0 and 0 < res.bytes_paged < int(flagged.sum()) * st.n * row
    assert bool((res.true_out_err <= res.out_bound).all())


def test_a_persistent_value_upgrade_stays_within_the_device_budget():
    fresh = _store(6)[0]
    budget = (fresh.bytes_device() + 64) / fresh.bytes_fp16()  # room for about one upgrade record
    st, q, mask = _store(6, device_budget=budget)
    res = _read(st, q, mask, Gate.certified(1.0, granularity="block", block_size=1, persistent=True, value_rel=0.06))
    assert bool(res.values_upgraded.any())
    assert st.bytes_device() <= budget * st.bytes_fp16() and st.transient_repairs > 0  # refused: for the read only
    assert bool((res.true_out_err <= res.out_bound).all())


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan])
def test_bad_value_rel_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="value_rel"):
        Gate.certified(0.2, value_rel=bad)


def test_value_rel_is_for_certified_gates():
    with pytest.raises(ValueError, match="value_rel"):
        Gate.risk_ranked(5.0).__class__("risk_ranked", 5.0, value_rel=0.1)
    with pytest.raises(ValueError, match="off gate"):
        Gate("off", value_rel=0.1)
    with pytest.raises(TypeError, match="value_rel"):
        Gate.certified(0.2, value_rel="0.1")  # type: ignore[arg-type]
    assert Gate.certified(0.2, value_rel=0.1).describe() == "certified(tau=0.2, head, value_rel=0.1)"


@pytest.mark.parametrize("persistent", [False, True])
def test_after_a_key_upgrade_repair_the_value_gate_starts_from_what_the_repair_served(persistent):
    """A head the key gate repaired on upgraded codes (values upgraded with its keys) is value-gated from those
    values: no entry is upgraded twice, every cell is under its tolerance and its output bound holds."""
    st, q, mask = _store(7)
    spread = _spread(st, mask).repeat_interleave(G, 1).unsqueeze(-1)
    gate = Gate.certified(0.2, granularity="block", block_size=1, persistent=persistent, value_rel=0.04)
    res = _read(st, q, mask, gate)
    assert bool(((res.blocks > 0) & (res.values_upgraded | res.values_promoted)).any())
    assert bool((res.value_term <= 0.04 * spread * (1 + 1e-12)).all())
    assert bool((res.true_out_err <= res.out_bound).all()), float((res.true_out_err - res.out_bound).max())
    assert bool((res.cert <= 0.2).all())
    if persistent:
        _assert_slack_covers_the_served_values(st, res)
    if persistent:  # every kept record holds entries no other record of its head holds
        for ts in (st.k, st.v):
            for b in range(B):
                for h in range(HKV):
                    slots = torch.cat([u.slots for u in ts.upgrades if (u.b, u.h) == (b, h)] or [torch.zeros(0)])
                    assert len(slots) == len(slots.unique())


def test_after_an_upgrade_repair_vmax_bounds_the_values_it_served():
    """The key gate's upgrade repair serves upgraded values too: the slack's ``vmax`` of its heads is raised to their
    norms (never lowered), the other heads' left as they were."""
    from types import SimpleNamespace

    from kvcert.attention.certified import _served_vmax

    vmax = torch.tensor([[[1.0], [5.0]], [[2.0], [3.0]]], dtype=torch.float64)  # [B, HKV, 1]
    values = torch.zeros(2, 4, D)
    values[0, 1, 0], values[1, 2, 3] = 4.0, 1.0  # norms 4 (above the head's 2) and 1 (below its 5)
    repairs = SimpleNamespace(heads=torch.tensor([[1, 0], [0, 1]]), values=values)
    out = _served_vmax(vmax, repairs)
    assert out[0, 0, 0] == 1.0 and out[0, 1, 0] == 5.0 and out[1, 1, 0] == 3.0  # unrepaired, or already above
    assert 4.0 <= float(out[1, 0, 0]) <= 4.0 * (1 + 2**-20) and vmax[1, 0, 0] == 2.0  # raised (norm rounded up)
    assert _served_vmax(vmax, None) is vmax
