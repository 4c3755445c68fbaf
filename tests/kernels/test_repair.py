"""Batched block repair (``kvcert.kernels.repair``) against the per-head procedure it replaces, per head and cell."""

from __future__ import annotations

import math

import pytest
import torch

from kvcert.bounds import true_tv
from kvcert.bounds.rc import gamma_f32
from kvcert.bounds.softmax_tv import probs64, served_meter
from kvcert.cache.gate import Gate
from kvcert.cache.store import LayerStore
from kvcert.kernels.repair import _in_place, _mix, _page, repair_blocks, repaired_read
from kvcert.quant import get, kernel_env

torch.set_num_threads(1)
SC = 0.125
BACKENDS = ("numba", "torch")  # the repaired read's softmax and meter: the fused row kernel, or the eager forms


def _pairs(need: torch.Tensor) -> list[tuple[int, int]]:
    """``need``'s heads as the caller's decision lists them on the host."""
    return [(bi, hi) for bi, hi in need.nonzero().tolist()]


def _per_head(q, khat, hk, m, c, p, gate, fused):
    """The per-head procedure (one head at a time, a host decision per doubling): the oracle, evaluating each
    recomputed read as the backend does (``fused``: the row kernel; else :func:`probs64` and :func:`served_meter`)."""
    s, bs = khat.shape[0], gate.block_size
    nb = (s + bs - 1) // bs
    rows = torch.nn.functional.pad(p * torch.expm1(c), (0, nb * bs - s)).reshape(p.shape[0], nb, bs).sum(-1)
    order = torch.argsort(rows.amax(0), descending=True, stable=True)
    remaining = rows.sum(-1, keepdim=True) - rows[:, order].cumsum(-1)
    ok = (0.5 * ((1.0 + remaining.clamp(min=0)) ** 2 - 1.0) <= gate.threshold).all(0)
    k = int(ok.to(torch.int64).argmax()) + 1 if bool(ok.any()) else nb
    while True:
        tok = torch.zeros(nb, bs, dtype=torch.bool)
        tok[order[: min(k, nb)]] = True
        tok = tok.reshape(-1)[:s]
        logits = (q @ torch.where(tok.unsqueeze(-1), hk, khat).T * SC).masked_fill(~m, -math.inf)
        if fused:
            pm, cert, raw = repaired_read(logits, torch.where(tok, 0.0, c), True)
        else:
            pm = probs64(logits)
            cert, raw = served_meter(pm, torch.where(tok, 0.0, c))
        if bool(((raw if gate.uses_unclipped else cert) <= gate.threshold).all()) or k >= nb:
            return tok, cert, pm, min(k, nb)
        k *= 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tau", [0.0, 0.01, 0.2])
def test_batched_block_repair_makes_the_per_head_choice_and_certifies_every_cell(tau, backend, monkeypatch) -> None:
    monkeypatch.setenv(kernel_env.ENV, backend)
    gen = torch.Generator().manual_seed(3)
    b, h, m_rows, d, s = 2, 3, 4, 32, 100
    store = LayerStore(0, get("int2"), get("int4"), bands=4, pairing="rotate_half", seed=1)
    k = torch.randn(b, h, s, d, generator=gen) * 2
    v = torch.randn(b, h, s, d, generator=gen)
    store.append(k, v, torch.arange(b), torch.zeros(b, dtype=torch.bool))
    store.encode_pending(flush=True)
    q = torch.randn(b, h, m_rows, d, generator=gen) * 2
    mask = torch.rand(b, h, m_rows, s, generator=gen) > 0.2
    mask[1, 2, 0] = False  # a row that sees nothing
    khat = store.k.served.view()
    logits = (SC * q) @ khat.transpose(-1, -2)
    p = probs64(logits.masked_fill(~mask, -math.inf))
    c = torch.rand(b, h, m_rows, s, generator=gen) * 0.3  # any non-negative radii
    need = torch.tensor([[True, False, True], [False, True, True]])
    gate = Gate.certified(tau, granularity="block", block_size=16)
    res = repair_blocks(q, store, need, _pairs(need), mask, c, p, SC, gate)
    assert res.heads.tolist() == need.nonzero().tolist() and res.n_tokens == int(res.tokens.sum())
    host_k, host_v = store.k.host.view(), store.v.host.view()
    for j, (bi, hi) in enumerate(res.heads.tolist()):
        tok, cert, pm, nblk = _per_head(
            q[bi, hi], khat[bi, hi], host_k[bi, hi], mask[bi, hi], c[bi, hi], p[bi, hi], gate, backend == "numba"
        )
        assert torch.equal(res.tokens[j], tok) and int(res.n_blocks[j]) == nblk
        assert torch.allclose(res.cert[j], cert, rtol=1e-12, atol=1e-15)
        assert torch.allclose(res.p[j], pm, rtol=1e-12, atol=1e-300)
        assert bool((res.cert[j] <= tau).all()) or nblk == (s + 15) // 16
        # what is served: exact K/V on paged tokens, codes elsewhere; its output and residual norms follow
        vmix = torch.where(tok.unsqueeze(-1), host_v[bi, hi], store.v.served.view()[bi, hi])
        assert torch.allclose(res.out[j], pm.to(torch.float32) @ vmix, rtol=1e-5, atol=1e-6)
        assert torch.equal(res.v_res[j], torch.where(tok, 0.0, store.v_res.view()[bi, hi]))
    assert (res.n_blocks > 0).all() if tau == 0.0 else True


@pytest.mark.parametrize("backend", BACKENDS)
def test_repaired_certificate_bounds_the_true_tv_per_cell(backend, monkeypatch) -> None:
    """Per cell the repaired meter is at least the TV to the dense read as computed (validate mode's reference,
    ``docs/read-path.md#validate-mode``: float32 logits of the exact keys, the repair's own evaluation of paged
    tokens, whose radius is 0); unpaged tokens keep a radius covering their logit error to it."""
    monkeypatch.setenv(kernel_env.ENV, backend)
    gen = torch.Generator().manual_seed(5)
    b, h, m_rows, d, s = 1, 2, 3, 32, 80
    store = LayerStore(0, get("int2"), get("int2"), bands=4, pairing="rotate_half", seed=1)
    k, v = torch.randn(b, h, s, d, generator=gen) * 3, torch.randn(b, h, s, d, generator=gen)
    store.append(k, v, torch.arange(b), torch.zeros(b, dtype=torch.bool))
    store.encode_pending(flush=True)
    q = torch.randn(b, h, m_rows, d, generator=gen) * 3
    mask = torch.ones(b, h, m_rows, s, dtype=torch.bool)
    khat = store.k.served.view()
    p = probs64((SC * q) @ khat.transpose(-1, -2))
    # radius: Cauchy–Schwarz on the key residual plus the float32 slack of the served logits (docs/math.md)
    qn = q.to(torch.float64).norm(dim=-1, keepdim=True)
    dk = (khat - k).to(torch.float64).norm(dim=-1).unsqueeze(2)
    kn = khat.to(torch.float64).norm(dim=-1).unsqueeze(2)
    c = (SC * qn * dk + SC * gamma_f32(d + 1) * qn * (2 * kn + dk)) * (1 + 1e-12)
    gate = Gate.certified(0.05, granularity="block", block_size=8)
    need = torch.ones(b, h, dtype=torch.bool)
    res = repair_blocks(q, store, need, _pairs(need), mask, c, p, SC, gate)
    exact = probs64(q @ k.transpose(-1, -2) * SC)
    for j, (bi, hi) in enumerate(res.heads.tolist()):
        tv = true_tv(exact[bi, hi], res.p[j])
        assert bool((tv <= res.cert[j] + 1e-9).all()), float((tv - res.cert[j]).max())
        assert bool((res.cert[j] <= 0.05).all())


def _upgrade_case(tau: float, scale: float = 1.0, keys: str = "int2", block_size: int = 8, aimed: bool = False):
    """A store of ``keys`` keys and int2 values with upgrade codecs int8 / int4, a read of it with Cauchy–Schwarz
    radii from its witnesses (``aimed``: each query a stored key times ``scale``, a concentrated read), and its block
    repair under ``tau`` (persistent, blocks of ``block_size``)."""
    gen = torch.Generator().manual_seed(7)
    b, h, m_rows, d, s = 1, 2, 3, 32, 80
    store = LayerStore(
        0, get(keys), get("int2"), bands=4, pairing="rotate_half", seed=1, upgrade=(get("int8"), get("int4"))
    )
    k, v = torch.randn(b, h, s, d, generator=gen) * scale, torch.randn(b, h, s, d, generator=gen)
    store.append(k, v, torch.arange(b), torch.zeros(b, dtype=torch.bool))
    store.encode_pending(flush=True)
    q = torch.randn(b, h, m_rows, d, generator=gen) * scale
    if aimed:
        q = k[:, :, torch.randint(0, s, (m_rows,), generator=gen)] * 2.0
    mask = torch.ones(b, h, m_rows, s, dtype=torch.bool)

    def radii(heads, k_band, k_hat_norm, k_wit):  # Cauchy–Schwarz on the residual witness plus the float32 slack
        qn = q[heads].to(torch.float64).norm(dim=-1, keepdim=True)
        w, kn = k_wit.to(torch.float64).unsqueeze(-2), k_hat_norm.to(torch.float64).unsqueeze(-2)
        return (SC * qn * w + SC * gamma_f32(d + 1) * qn * (2 * kn + w)) * (1 + 1e-12)

    every = (torch.arange(b).repeat_interleave(h), torch.arange(h).repeat(b))
    wit = [x.view()[every] for x in (store.k_band, store.k_hat_norm, store.k_wit)]
    c = radii(every, *wit).view(b, h, m_rows, s)
    p = probs64((SC * q) @ store.k.served.view().transpose(-1, -2))
    gate = Gate.certified(tau, granularity="block", block_size=block_size, persistent=True)
    need = torch.ones(b, h, dtype=torch.bool)
    res = repair_blocks(q, store, need, _pairs(need), mask, c, p, SC, gate, key_radii=radii)
    return store, k, q, res


@pytest.mark.parametrize("backend", BACKENDS)
def test_upgrade_repair_serves_the_new_codes_within_their_certificate_per_cell(backend, monkeypatch) -> None:
    """With upgrade codecs the repaired read serves the chosen entries from their new codes (radii from the new
    codes' witnesses), keeps exactly those codes, pages nothing in exact, and its traffic is the new codes' and
    witnesses' measured bytes; per cell its certificate bounds the TV to the dense read."""
    monkeypatch.setenv(kernel_env.ENV, backend)
    store, k, q, res = _upgrade_case(0.05)
    assert bool(res.upgraded.all()) and res.n_tokens == 0 and bool(res.tokens.any())
    exact = probs64(q @ k.transpose(-1, -2) * SC)
    for j, (bi, hi) in enumerate(res.heads.tolist()):
        tv = true_tv(exact[bi, hi], res.p[j])
        assert bool((tv <= res.cert[j] + 1e-9).all()), float((tv - res.cert[j]).max())
        assert bool((res.cert[j] <= 0.05).all())
    records = store.k.upgrades + store.v.upgrades
    for ts, codec in ((store.k, get("int8")), (store.v, get("int4"))):  # what is kept is what was served
        for u in ts.upgrades:
            assert torch.equal(ts.served.view()[u.b, u.h, u.slots], codec.decode(u.packed)[0, 0])
    assert {(u.b, u.h): u.slots.tolist() for u in store.k.upgrades} == {
        (bi, hi): res.tokens[j].nonzero().view(-1).tolist() for j, (bi, hi) in enumerate(res.heads.tolist())
    }
    entries = sum(len(u.slots) for u in store.k.upgrades)
    assert res.upgrade_bytes == sum(u.packed.nbytes for u in records) + entries * (4 + 1)  # log8: 4 bands and v_res


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_head_no_upgrade_passes_gets_every_light_entry_upgraded_and_the_blocks_it_needs_exact(
    backend, monkeypatch
) -> None:
    """When even every light entry upgraded leaves a cell over the threshold, the repair serves the head with its light
    entries upgraded and pages in exact, over that, the blocks it still needs (radius 0): the exact ones are held
    exact, the others keep their new codes; per cell the certificate bounds the TV to the dense read."""
    monkeypatch.setenv(kernel_env.ENV, backend)
    store, k, q, res = _upgrade_case(0.02)
    assert not bool(res.upgraded.any()) and 0 < res.n_tokens < res.tokens.numel() and bool(res.tokens.all())
    exact = probs64(q @ k.transpose(-1, -2) * SC)
    for j, (bi, hi) in enumerate(res.heads.tolist()):
        tv = true_tv(exact[bi, hi], res.p[j])
        assert bool((tv <= res.cert[j] + 1e-9).all()), float((tv - res.cert[j]).max())
        assert bool((res.cert[j] <= 0.02).all())
    held = store.k.held.view()[0] & store.v.held.view()[0]
    assert int(held.sum()) == res.n_tokens and store.n_held == 2 * res.n_tokens
    upgraded = torch.zeros_like(held)
    for u in store.k.upgrades:
        upgraded[u.h, u.slots] = True
    assert not bool((held & upgraded).any()) and bool((held | upgraded).all())  # every entry one or the other
    assert torch.equal(store.k.served.view()[0][held], k[0][held])  # the held ones are exact
    entries = sum(len(u.slots) for u in store.k.upgrades)
    records = sum(u.packed.nbytes for u in store.k.upgrades + store.v.upgrades)
    assert res.upgrade_bytes == records + entries * (4 + 1)


@pytest.mark.parametrize(
    ("tau", "case"),
    [(0.2, {"keys": "int4", "block_size": 1, "aimed": True}), (0.05, {"keys": "int4", "block_size": 1, "aimed": True})]
    + [(tau, {}) for tau in (0.05, 0.02, 0.0)],
)
def test_lazy_planning_makes_the_choice_planning_every_light_entry_makes(tau, case, monkeypatch) -> None:
    """An upgrade repair plans only the light entries of each head's first blocks and runs a head again, with every
    light entry planned, when its rounds would go past them: what it serves, keeps and sends is what planning every
    light entry at once gives, bit for bit, whether no head, some or every head goes past its first plan."""
    from kvcert.kernels import repair as repair_module

    def run(min_blocks: int, rounds: int):
        monkeypatch.setattr(repair_module, "PLAN_MIN_BLOCKS", min_blocks)
        monkeypatch.setattr(repair_module, "PLAN_ROUNDS", rounds)
        store, _, _, res = _upgrade_case(tau, **case)
        return store, res

    every_store, every = run(10**9, 0)  # the first plan holds every light entry
    replanned = []
    replaced = repair_module._Upgrades.replaced
    monkeypatch.setattr(
        repair_module._Upgrades,
        "replaced",
        lambda self, rows, other: replanned.append(rows) or replaced(self, rows, other),
    )
    for min_blocks, rounds in ((1, 0), (2, 1), (4, 2)):
        store, res = run(min_blocks, rounds)
        for name in ("tokens", "cert", "raw", "p", "out", "v_res", "n_blocks", "upgraded", "values"):
            assert torch.equal(getattr(res, name), getattr(every, name)), name
        assert (res.n_tokens, res.upgrade_bytes) == (every.n_tokens, every.upgrade_bytes)
        for ts, ref in ((store.k, every_store.k), (store.v, every_store.v)):
            assert [(u.b, u.h, u.slots.tolist()) for u in ts.upgrades] == [
                (u.b, u.h, u.slots.tolist()) for u in ref.upgrades
            ]
            assert torch.equal(ts.served.view(), ref.served.view())
    assert bool(replanned) == (case != {})  # the concentrated reads double past their first plan; the others do not


def test_at_tau_0_an_upgrade_repair_pages_everything_in_exact() -> None:
    store, k, q, res = _upgrade_case(0.0)  # no nonzero radius passes tau = 0
    assert not bool(res.upgraded.any()) and bool(res.tokens.all()) and res.n_tokens == res.tokens.numel()
    assert res.upgrade_bytes == 0 and not store.k.upgrades and not store.v.upgrades
    assert bool((res.cert == 0).all()) and store.n_held == 2 * res.n_tokens


def test_fused_repaired_read_refines_the_eager_one_per_cell() -> None:
    """The fused evaluation of a repaired read (CPU row kernel) against the eager forms on the same logits and
    radii, per cell: the same distribution up to float64 rounding, a meter never below the eager one by more than
    float64 rounding nor above it by more than the kernel's rounding allowance, fully masked rows and rows with
    every radius 0 give 0."""
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(6, 4, 300, generator=gen) * 3).to(torch.float32)
    logits[1, 1] = float("-inf")  # a row that sees nothing
    logits[2, :, ::3] = float("-inf")
    c = torch.rand(6, 4, 300, generator=gen) * torch.tensor([0.0, 0.01, 0.3, 2.0, 8.0, 40.0]).view(6, 1, 1)
    c[3, :, :100] = 0.0  # paged tokens
    p_f, cert_f, raw_f = repaired_read(logits, c, True)
    p_e, cert_e, raw_e = repaired_read(logits, c, False)
    assert torch.allclose(p_f, p_e, rtol=1e-12, atol=1e-15)
    near = raw_e <= 10.0
    gap = raw_f[near] - raw_e[near]
    assert bool((gap >= -1e-12).all()) and bool((gap <= 1e-9).all()), (float(gap.min()), float(gap.max()))
    assert bool((raw_f[~near] >= raw_e[~near] * (1 - 1e-12)).all())
    assert torch.equal(cert_f, raw_f.clamp(max=1.0))
    assert float(raw_f[1, 1]) == float(raw_e[1, 1]) == 0.0
    assert bool((raw_f[0] == 0.0).all()) and bool((raw_e[0] == 0.0).all())  # zero radii: p̃ = p, TV 0


def test_in_place_mix_equals_the_paged_where_bit_for_bit() -> None:
    """The CPU form of the repair's K/V mixture (the host tier's entries of the paged tokens written into the served
    copy, round after growing round) holds exactly the elements of ``where(tok, paged host slices, served)``, the
    form off CPU."""
    gen = torch.Generator().manual_seed(9)
    host = torch.randn(2, 3, 50, 16, generator=gen)
    served_all = host + 0.01 * torch.randn(2, 3, 50, 16, generator=gen)
    pairs = [(0, 2), (1, 0), (1, 1)]
    bi, hi = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
    assert _in_place(torch.device("cpu"), (host,))
    paged = _page(host, pairs, torch.device("cpu"))
    tok = torch.rand(3, 50, generator=gen) > 0.8
    in_place = served_all[bi, hi]
    for grow in (tok, tok | (torch.rand(3, 50, generator=gen) > 0.5)):  # tok only grows between rounds
        want = _mix(served_all[bi, hi], host, paged, grow, pairs)
        got = _mix(in_place, host, None, grow, pairs)
        assert got.data_ptr() == in_place.data_ptr()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert not torch.equal(want, served_all[bi, hi])


def test_block_repair_without_a_head_is_refused() -> None:
    store = LayerStore(0, get("int4"), get("int4"), bands=4, pairing="rotate_half", seed=1)
    store.append(torch.randn(1, 1, 8, 32), torch.randn(1, 1, 8, 32), torch.arange(1), torch.zeros(1, dtype=torch.bool))
    store.encode_pending(flush=True)
    q, mask = torch.randn(1, 1, 2, 32), torch.ones(1, 1, 2, 8, dtype=torch.bool)
    p, c = probs64(q @ store.k.served.view().transpose(-1, -2)), torch.zeros(1, 1, 2, 8, dtype=torch.float64)
    need = torch.zeros(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="at least one head"):
        repair_blocks(q, store, need, [], mask, c, p, SC, Gate.certified(0.1, granularity="block", block_size=4))
