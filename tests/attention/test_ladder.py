"""ladder_read (RC four-rung ladder) on synthetic stores and a tiny live model.

Contract per cell (every row, query head, query): ‖out − O_ref‖₂ ≤ out_bound, where O_ref is exact attention
over the host tier in float64; rung 3/4 heads are bit-for-bit the exact SDPA output. Counters move when
(and only when) each rung's condition is constructed.
"""

from __future__ import annotations

import pytest
import torch

from kvcert.attention.ladder import LadderConfig, LadderStats, ladder_read
from kvcert.bounds import query_band_norms, tier_a_radius_from_qnorms
from kvcert.bounds.rc import logit_rounding_radius, mass_lemma_bound
from kvcert.cache.store import LayerStore
from kvcert.quant import get

torch.set_num_threads(1)
B, HKV, G, D = 2, 2, 3, 64
SC = D**-0.5


def _setup(keys: str, values: str, s: int, seed: int, qscale: float, nq: int = 1, needle: bool = False):
    g = torch.Generator().manual_seed(seed)
    st = LayerStore(0, get(keys), get(values), bands=8, pairing="rotate_half", seed=seed)
    k = torch.randn(B, HKV, s, D, generator=g) * torch.rand(1, 1, s, 1, generator=g) * 3
    v = torch.randn(B, HKV, s, D, generator=g)
    q = torch.randn(B, HKV * G, nq, D, generator=g) * qscale
    if needle:  # one key aligned with every query: a dominant block
        k[:, :, 40] = q.reshape(B, HKV, G * nq, D).mean(2) * 0.2
    rows, keep = torch.arange(B), torch.zeros(B, dtype=torch.bool)
    st.append(k, v, rows, keep)
    st.append(torch.randn(B, HKV, nq, D, generator=g), torch.randn(B, HKV, nq, D, generator=g), rows, keep)
    n = st.n
    mask = torch.ones(B, 1, nq, n, dtype=torch.bool)
    mask[1, :, :, : s // 4] = False  # left padding on row 1
    mask = mask & (torch.arange(n).view(1, 1, 1, n) <= (n - nq + torch.arange(nq)).view(1, 1, nq, 1))
    return st, q, mask


def _exact(q, mask):
    def fn(hk, hv, m=None):  # m: the mask the read path passes (None: the test's own)
        rep = torch.repeat_interleave
        out = torch.nn.functional.scaled_dot_product_attention(
            q, rep(hk.to(q.dtype), G, 1), rep(hv.to(q.dtype), G, 1), attn_mask=mask if m is None else m, scale=SC
        )
        return out.transpose(1, 2)

    return fn


def _grouped_mask(mask, nq, s):
    return mask[:, :, None].expand(B, HKV, G, nq, s).reshape(B, HKV, G * nq, s)


def _reference(st, q, mask):
    """Exact attention in float64 (real-arithmetic stand-in): probabilities and output, grouped layout."""
    nq, s = q.shape[2], st.n
    qg = q.double().reshape(B, HKV, G * nq, D)
    m = _grouped_mask(mask, nq, s)
    logits = (qg @ st.k.host.view().double().transpose(-1, -2) * SC).masked_fill(~m, float("-inf"))
    p = torch.softmax(logits, -1)
    return p, p @ st.v.host.view().double(), m


def _check_contract(st, q, mask, res, exact_out):
    nq = q.shape[2]
    _, o_ref, _ = _reference(st, q, mask)
    out = res.out.double().transpose(1, 2).reshape(B, HKV, G * nq, -1)
    err = (out - o_ref).norm(dim=-1).reshape(B, HKV * G, nq)
    assert torch.all(err <= res.out_bound), (err - res.out_bound).max()
    exact_heads = (res.out == exact_out).all(1).all(-1)  # [B, Hq] bit-for-bit equal heads
    # a head reported exact (rung 3/4: cert 0, no terms) must equal SDPA bit for bit
    reported_exact = (res.cert == 0).all(-1) & (res.key_term == 0).all(-1) & (res.value_term == 0).all(-1)
    assert torch.all(exact_heads[reported_exact])
    assert torch.equal(reported_exact.reshape(B, HKV, G).any(-1), res.repaired)


CODECS = [
    ("int8", "int4"),
    ("int4", "int4"),
    ("int2", "int2"),
    ("dither-int8", "int4"),
    ("fp8-e4m3", "int8"),
    ("kvquant-4", "int4"),
]


@pytest.mark.parametrize("keys,values", CODECS)
@pytest.mark.parametrize("qscale", [0.3, 3.0, 30.0])
def test_contract_every_cell(keys, values, qscale):
    for seed in range(2):
        st, q, mask = _setup(keys, values, 150, seed, qscale, nq=2)
        stats = LadderStats()
        cfg = LadderConfig(k_max=3, validate=True)
        exact = _exact(q, mask)
        res = ladder_read(q, st, mask, SC, cfg, exact, stats)
        _check_contract(st, q, mask, res, exact(st.k.host.view(), st.v.host.view()))
        assert torch.all(res.true_out_err <= res.out_bound)
        assert torch.all(res.true_tv <= res.cert_pre)
        assert stats.reads == 1 and stats.cells == B * HKV * G * 2


def test_served_tv_and_mass_lemma_per_cell_vs_bruteforce():
    """cert ≥ TV(p^mix, p) per served cell; α_T ≤ e^{2C}α̂_T per cell with the store's own witness."""
    for keys, qscale in [("int4", 3.0), ("int2", 1.0), ("int8", 10.0)]:
        st, q, mask = _setup(keys, "int4", 160, 3, qscale)
        stats = LadderStats()
        res = ladder_read(q, st, mask, SC, LadderConfig(k_max=2, tail_trigger=0.5), _exact(q, mask), stats)
        p, _, m = _reference(st, q, mask)
        f_tok = stats.last_key_paged
        qg = q.float().reshape(B, HKV, G, D)
        kmix = torch.where(f_tok.unsqueeze(-1), st.k.host.view(), st.k.served.view()).double()
        p_mix = torch.softmax((qg.double() @ kmix.transpose(-1, -2) * SC).masked_fill(~m, float("-inf")), -1)
        tv = 0.5 * (p_mix - p).abs().sum(-1).reshape(B, HKV * G, 1)
        served = ~res.repaired.repeat_interleave(G, 1).unsqueeze(-1)
        assert torch.all((tv <= res.cert) | ~served)
        # mass lemma with the store witness (Tier-A radius + rounding radius)
        khat = st.k.served.view()
        logits_hat = (qg @ khat.transpose(-1, -2) * SC).double().masked_fill(~m, float("-inf"))
        band = st.k_band.view().unsqueeze(2)
        c = tier_a_radius_from_qnorms(query_band_norms(qg, 8, "rotate_half"), band, SC)
        qn = qg.double().norm(dim=-1, keepdim=True)
        c = c + logit_rounding_radius(qn, st.k_hat_norm.view().unsqueeze(2), band.double().sum(-1), SC, D)
        tail = m & (~f_tok & ~st.k.exact.view()).unsqueeze(2)
        alpha = torch.where(tail, p, 0.0).sum(-1)
        alpha_hat = torch.where(tail, torch.softmax(logits_hat, -1), 0.0).sum(-1)
        assert torch.all(alpha <= mass_lemma_bound(alpha_hat, torch.where(m, c, 0.0).amax(-1)))
        assert (alpha > 0).any()


def test_rung1_doubles_when_tail_mass_exceeds_trigger():
    st, q, mask = _setup("int8", "int8", 160, 0, 0.3)  # flat attention: K_max=2 leaves a big tail
    on, off = LadderStats(), LadderStats()
    ladder_read(q, st, mask, SC, LadderConfig(k_max=2), _exact(q, mask), on)
    ladder_read(q, st, mask, SC, LadderConfig(k_max=2, tail_trigger=0.999), _exact(q, mask), off)
    assert on.rung1 == on.cells and off.rung1 == 0
    assert on.blocks_paged > off.blocks_paged


def test_rung2_promotes_value_blocks_and_zeroes_their_value_term():
    st, q, mask = _setup("int8", "int2", 96, 1, 1.0)
    s_on, s_off = LadderStats(), LadderStats()
    exact = _exact(q, mask)
    on = ladder_read(q, st, mask, SC, LadderConfig(v_tol=0.0, validate=True), exact, s_on)
    off = ladder_read(q, st, mask, SC, LadderConfig(v_tol=1e9, validate=True), exact, s_off)
    assert s_on.rung2 > 0 and s_off.rung2 == 0
    assert on.values_promoted.all() and not off.values_promoted.any()
    served = ~on.repaired.repeat_interleave(G, 1)
    assert torch.all(on.value_term[served] == 0) and torch.all(off.value_term[served] > 0)
    assert torch.all(on.true_out_err <= on.out_bound) and torch.all(off.true_out_err <= off.out_bound)
    assert on.bytes_paged > off.bytes_paged


def test_rung3_fires_on_ranking_doubt_and_returns_sdpa_bit_for_bit():
    st, q, mask = _setup("int4", "int4", 160, 2, 1.0)  # coarse keys, flat ranking, small K
    stats = LadderStats()
    exact = _exact(q, mask)
    res = ladder_read(q, st, mask, SC, LadderConfig(k_max=2, tail_trigger=0.9), exact, stats)
    dense = exact(st.k.host.view(), st.v.host.view())
    assert stats.rung3 > 0 and stats.rung4 == 0
    heads = res.cert.amax(-1) == 0
    assert heads.sum() == stats.rung3
    assert (~heads).any()
    for bi in range(B):
        assert torch.equal(res.out[bi][:, heads[bi]], dense[bi][:, heads[bi]])
        if (~heads[bi]).any():
            assert not torch.equal(res.out[bi][:, ~heads[bi]], dense[bi][:, ~heads[bi]])
    _check_contract(st, q, mask, res, dense)


def test_rung3_quiet_when_one_block_dominates():
    st, q, mask = _setup("int8", "int8", 160, 4, 1.0, needle=True)
    stats = LadderStats()
    ladder_read(q, st, mask, SC, LadderConfig(), _exact(q, mask), stats)
    assert stats.rung3 == 0 and stats.rung4 == 0


def test_rung4_monitor_catches_corrupt_witness_and_serves_dense_layer():
    st, q, mask = _setup("int4", "int4", 96, 5, 2.0)
    exact = _exact(q, mask)
    clean = LadderStats()
    ladder_read(q, st, mask, SC, LadderConfig(tau_cov=1.0), exact, clean)
    assert clean.rung4 == 0
    st.k.served.view()[0, 1, 16:32] += 0.5  # stale decode: witness no longer covers it
    stats = LadderStats()
    res = ladder_read(q, st, mask, SC, LadderConfig(tau_cov=1.0), exact, stats)
    assert stats.rung4 == 1 and stats.rung3 == 0
    assert torch.equal(res.out, exact(st.k.host.view(), st.v.host.view()))
    assert res.repaired.all() and torch.all(res.cert == 0)
    assert res.bytes_paged == B * HKV * st.n * 2 * D * 4


def test_bad_input_raises_naming_the_problem():
    st, q, mask = _setup("int8", "int8", 48, 0, 1.0)
    exact = _exact(q, mask)
    for kw, name in [
        ({"tau_cov": 0.0}, "tau_cov"),
        ({"k_min": 3, "k_max": 2}, "k_min"),
        ({"v_tol": -1}, "v_tol"),
        ({"block_size": 0}, "block_size"),
        ({"tail_trigger": 1.0}, "tail_trigger"),
        ({"eps_guard": -1.0}, "eps_guard"),
    ]:
        with pytest.raises(ValueError, match=name):
            LadderConfig(**kw)
    with pytest.raises(ValueError, match="mask"):
        ladder_read(q, st, mask.float(), SC, LadderConfig(), exact)
    with pytest.raises(ValueError, match="q shape"):
        ladder_read(q[:, :, :, :32], st, mask, SC, LadderConfig(), exact)
    with pytest.raises(ValueError, match="non-finite"):
        ladder_read(q * float("nan"), st, mask, SC, LadderConfig(), exact)
    with pytest.raises(ValueError, match="scaling"):
        ladder_read(q, st, mask, 0.0, LadderConfig(), exact)
    empty = LayerStore(0, get("int8"), get("int8"), bands=8, pairing="rotate_half", seed=0)
    with pytest.raises(ValueError, match="empty"):
        ladder_read(q, empty, mask, SC, LadderConfig(), exact)


def test_live_tiny_model_zero_violations():
    """CertifiedCache(ladder=True) serves through ladder_read; validate mode finds no violation."""
    from kvcert.integrations.transformers import CertifiedCache
    from kvcert.models.tiny import tiny_random

    model = tiny_random("llama", head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (2, 72), generator=torch.Generator().manual_seed(0))
    # small K_max so rung 1 pages blocks
    cache = CertifiedCache(model, keys="int4", values="int4", validate=True, seed=0, ladder=LadderConfig(k_max=2))
    out = model(ids, cache=cache, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    for _ in range(6):
        out = model(nxt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
    cache.detach()
    tel = cache.telemetry()
    stats = cache.ladder_stats
    assert stats.reads >= 6 * model.config.num_hidden_layers and stats.blocks_paged > 0
    assert tel.violations == 0 and tel.out_violations == 0, tel.summary()
