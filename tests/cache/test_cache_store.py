"""LayerStore: write protocol, witnesses valid per entry, byte accounting from tensors, maintenance ops."""

from __future__ import annotations

import math

import pytest
import torch

from kvcert.bounds import band_norms
from kvcert.bounds.rope import norm_up_f32
from kvcert.cache.buffer import GrowBuffer, LogBuffer, WriteBatch
from kvcert.cache.gate import Gate
from kvcert.cache.store import LayerStore
from kvcert.quant import get, kernel_env
from kvcert.quant.norms_numba import norms_up


def _store(keys="int8", values="int4", **kw):
    return LayerStore(0, get(keys, **kw), get(values), bands=8, pairing="rotate_half", seed=1)


def _kv(b=2, h=3, t=10, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)


def _rows(b=2):
    return torch.arange(b), torch.zeros(b, dtype=torch.bool)


def test_new_tokens_pending_exact_then_encoded_on_next_write():
    st = _store()
    k, v = _kv()
    st.append(k, v, *_rows())
    assert st.k.exact.view().all() and st.k.n_encoded == 0
    assert torch.equal(st.k.served.view(), k)
    k2, v2 = _kv(t=1, seed=1)
    st.append(k2, v2, *_rows())
    assert st.k.n_encoded == 10 and not st.k.exact.view()[:, :, :10].any()
    assert st.k.exact.view()[:, :, 10].all()


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "dither-int8", "fp8-e4m3", "sign-1", "kvquant-4"])
def test_witness_bounds_every_entry(codec):
    st = _store(codec)
    k, v = _kv(t=32)
    st.append(k, v, *_rows())
    st.append(*_kv(t=1, seed=2), *_rows())
    served = st.k.served.view()[:, :, :32].double()
    resid = served - k.double()
    rho = st.k_band.view()[:, :, :32].double()
    exact_rho = band_norms(resid, 8, "rotate_half")
    assert torch.all(rho >= exact_rho)  # rounded up, never below
    assert torch.all(rho.sum(-1) >= resid.norm(dim=-1) * (1 - 1e-12))  # scalar witness W >= ||dk||
    vres = st.v_res.view()[:, :, :32].double()
    assert torch.all(vres >= (st.v.served.view()[:, :, :32].double() - v.double()).norm(dim=-1))
    _assert_norm_witnesses(st)


def _assert_norm_witnesses(st):
    """Every per-token norm witness bounds its norm from above, for every live token (pending or encoded)."""
    khat, vhat = st.k.served.view().double(), st.v.served.view().double()
    dk = khat - st.k.host.view().double()
    assert torch.all(st.k_wit.view().double() >= dk.norm(dim=-1))  # W_t >= ||dk||
    assert torch.all(st.k_wit.view().double() >= st.k_band.view().double().sum(-1))
    assert torch.all(st.k_hat_norm.view().double() >= khat.norm(dim=-1))
    assert torch.all(st.v_hat_norm.view().double() >= vhat.norm(dim=-1))
    assert torch.all(st.v_dist.view().double() >= (vhat - st.v_centre.double()).norm(dim=-1))


def test_norm_witnesses_follow_repair_trim_and_eviction():
    st = _store()
    k, v = _kv(t=40)
    st.append(k, v, *_rows())
    st.append(*_kv(t=1, seed=3), *_rows())
    centre = st.v_centre.clone()
    st.make_exact(0, 1, slice(3, 17))
    _assert_norm_witnesses(st)
    assert float(st.k_wit.view()[0, 1, 3:17].abs().max()) == 0.0
    st.gather(torch.tensor([0, 2, 5, 7, 30]).expand(2, 3, 5).contiguous())
    _assert_norm_witnesses(st)
    assert st.k_wit.n == st.v_dist.n == 5 and torch.equal(st.v_centre, centre)  # the centre never moves
    st2 = _store()
    st2.append(*_kv(t=20), *_rows())
    st2.append(*_kv(t=1, seed=4), *_rows())
    st2.drop_before(8)
    _assert_norm_witnesses(st2)


def test_kivi_keys_wait_for_token_block_and_residual_window():
    st = LayerStore(0, get("kivi-2", axis="key"), get("kivi-2", axis="value"), bands=8, pairing="rotate_half", seed=0)
    k, v = _kv(t=40)
    st.append(k, v, *_rows())
    st.append(*_kv(t=1, seed=3), *_rows())
    # 41 tokens, window 32 -> 9 encodable, but keys need whole 32-token blocks -> none yet
    assert st.k.n_encoded == 0
    st.append(*_kv(t=40, seed=4), *_rows())
    st.append(*_kv(t=1, seed=5), *_rows())
    assert st.k.n_encoded == 32 and st.k.exact.view()[:, :, 32:].all()


def test_bytes_are_measured_from_packed_tensors():
    st = _store("int8", "int4")
    st.append(*_kv(t=16), *_rows())
    st.append(*_kv(t=1, seed=1), *_rows())
    packed = sum(
        t.numel() * t.element_size() for ts in (st.k, st.v) for c in ts.chunks for t in c.packed.tensors.values()
    )
    pending = 2 * (2 * 3 * 1 * 64 * 2)  # one pending token per row/head, fp16, for K and for V
    assert st.bytes_stored() == packed + pending
    assert st.bytes_fp16() == 2 * 2 * 3 * 17 * 64 * 2
    # int8 G32 at D=64: 64 B codes + 4 B scales; int4: 32 + 4 -> (68 + 36) per token-head
    assert packed == 2 * 3 * 16 * (68 + 36)


def test_nonfinite_kept_exact_counted_and_never_quantized():
    st = _store()
    k, v = _kv(t=4)
    k[1, 2, 1, 5] = float("inf")
    st.append(k, v, *_rows())
    st.append(*_kv(t=1, seed=1), *_rows())
    assert st.nonfinite == 1
    assert st.k.exact.view()[1, 2, 1] and st.v.exact.view()[1, 2, 1]
    assert st.k_band.view()[1, 2, 1].sum() == 0


def test_fail_closed_rows_and_persistent_repair():
    st = _store()
    st.append(*_kv(t=8), torch.tensor([5, -1]), torch.tensor([False, True]))
    st.append(*_kv(t=1, seed=1), torch.tensor([5, -1]), torch.tensor([False, True]))
    assert st.fail_closed == 3 * 8 and st.k.exact.view()[1].all()
    _assert_norm_witnesses(st)  # norms of what is served: exact entries of a fail-closed row included
    moved = st.make_exact(0, 1, slice(2, 6))
    assert moved == 2 * 4 * 64 * 2
    assert torch.equal(st.k.served.view()[0, 1, 2:6], st.k.host.view()[0, 1, 2:6])
    assert st.k_band.view()[0, 1, 2:6].sum() == 0 and st.v_res.view()[0, 1, 2:6].sum() == 0


def test_sliding_trim_drops_old_chunks():
    st = _store()
    for i in range(4):
        st.append(*_kv(t=8, seed=i), *_rows())
    n_chunks = len(st.k.chunks)
    st.drop_before(16)
    assert st.n == 16 and st.base == 16 and len(st.k.chunks) < n_chunks


def test_growbuffer_append_view_gather():
    buf = GrowBuffer(torch.zeros(1, 2, 0, 3), capacity=2)
    for i in range(5):
        buf.append(torch.full((1, 2, 1, 3), float(i)))
    assert buf.view().shape == (1, 2, 5, 3) and buf.view()[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]
    buf.gather(torch.tensor([[[0, 3], [1, 4]]]))
    assert buf.view()[0, 0, :, 0].tolist() == [0, 3] and buf.view()[0, 1, :, 0].tolist() == [1, 4]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
)
def test_growbuffer_numpy_append_and_fill_store_what_torch_stores(dtype):
    """The numpy copy of a CPU append (same dtype) and the constant fill store, element for element, what
    ``narrow(...).copy_`` of the same tensors stores (bfloat16, which numpy lacks, and other dtypes take torch),
    for strided, broadcast and negative-view inputs, across a reallocation."""
    gen = torch.Generator().manual_seed(3)
    a, b = GrowBuffer(torch.zeros(2, 3, 0, 4, dtype=dtype), capacity=3), torch.empty(2, 3, 0, 4, dtype=dtype)
    raw = torch.randn(2, 3, 6, 8, generator=gen) * 100
    inputs = [raw[:, :, :2, ::2], raw[:, :, 2:3, :4].expand(2, 3, 1, 4), raw[:, :, 3:5, 4:].contiguous()]
    if dtype.is_floating_point:
        inputs.append(torch.zeros(2, 3, 2, 4).neg())  # -0.0 bits
        inputs.append(raw[:, :, :1, :4]._neg_view())  # a lazily negated view
    for x in inputs:
        x = x.to(dtype) if not x.is_neg() else x.resolve_neg().to(dtype)._neg_view()
        a.append(x)
        b = torch.cat([b, x.resolve_neg()], dim=2)
        a.append_fill(1, True if dtype == torch.bool else 7)
        b = torch.cat([b, torch.full((2, 3, 1, 4), True if dtype == torch.bool else 7, dtype=dtype)], dim=2)
    got = a.view()
    assert got.shape == b.shape and torch.equal(got.view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("kernel", ["numba", "torch"])
@pytest.mark.parametrize("dv", [64, 32])
def test_pending_norms_are_the_norms_of_each_entry(dv, kernel, monkeypatch):
    """The witnesses of pending (exact) entries, stored as float32 (``"f32"``), are per element the rounded-up norms
    ``‖k_t‖``, ``‖v_t‖`` and ``‖v_t − c‖``, over scales from 1e-6 to 1e6: on the tensor path exactly what
    ``norm_up_f32`` gives each tensor on its own (also when the three are evaluated together, with equal key and
    value head dims); on CPU by default exactly the fused kernel's values (:func:`norms_up`, never below the
    exact norm: ``tests/quant/test_norms_numba.py``), within two float32 steps of ``norm_up_f32``."""
    monkeypatch.setenv(kernel_env.ENV, kernel)
    gen = torch.Generator().manual_seed(11)
    st = LayerStore(0, get("int8"), get("int4"), bands=8, pairing="rotate_half", seed=1, write_block=64, witness="f32")
    rows, keep = torch.arange(2), torch.zeros(2, dtype=torch.bool)
    for i, scale in enumerate([1e-6, 1.0, 3e2, 1e6, 0.5]):
        k = torch.randn(2, 3, 1 + i % 3, 64, generator=gen) * scale
        v = torch.randn(2, 3, 1 + i % 3, dv, generator=gen) / scale
        st.append(k, v, rows, keep)
        t = k.shape[2]
        got = (st.k_hat_norm.view()[:, :, -t:], st.v_hat_norm.view()[:, :, -t:], st.v_dist.view()[:, :, -t:])
        tensor_form = (norm_up_f32(k), norm_up_f32(v), norm_up_f32(v.to(torch.float64) - st.v_centre))
        want = tensor_form if kernel == "torch" else norms_up(k, v, st.v_centre)
        for g, w, tf in zip(got, want, tensor_form, strict=True):
            assert torch.equal(g, w)
            assert (g.view(torch.int32).to(torch.int64) - tf.view(torch.int32).to(torch.int64)).abs().max() <= 2


def test_gate_validation_and_labels():
    assert Gate.off().describe() == "off"
    assert Gate.certified(0.2).describe() == "certified(tau=0.2, head)"
    assert Gate.certified(0.2, granularity="block").describe() == "certified(tau=0.2, block, transient)"
    assert (
        Gate.risk_ranked(5.0, granularity="block", persistent=True).describe()
        == "risk_ranked(tau_gate=5, block, persistent)"
    )
    assert Gate.risk_ranked(5.0, granularity="block", persistent=True).uses_unclipped
    with pytest.raises(ValueError, match="threshold"):
        Gate.certified(-1.0)
    with pytest.raises(ValueError, match="granularity"):
        Gate("certified", 0.2, "row")  # type: ignore[arg-type]


def test_exact_sinks_keep_the_first_positions_exact_with_zero_residual():
    gen = torch.Generator().manual_seed(0)
    st = LayerStore(0, get("dither-int6"), get("int4"), bands=8, pairing="rotate_half", seed=1, exact_sinks=4)
    k, v = torch.randn(1, 2, 20, 64, generator=gen), torch.randn(1, 2, 20, 64, generator=gen)
    st.append(k, v, torch.arange(1), torch.zeros(1, dtype=torch.bool))
    st.append(k[:, :, :1], v[:, :, :1], torch.arange(1), torch.zeros(1, dtype=torch.bool))
    assert st.k.exact.view()[:, :, :4].all() and not st.k.exact.view()[:, :, 4:20].any()
    assert torch.equal(st.k.served.view()[:, :, :4], k[:, :, :4])
    assert (st.k_band.view()[:, :, :4] == 0).all() and (st.v_res.view()[:, :, :4] == 0).all()
    assert (st.k_band.view()[:, :, 4:20] > 0).all()
    assert st.fail_closed == 0  # sinks are a choice, not a fail-closed identity
    with pytest.raises(ValueError, match="exact_sinks"):
        LayerStore(0, get("int8"), get("int8"), bands=8, pairing="rotate_half", seed=1, exact_sinks=-1)


@pytest.mark.parametrize("bands", [0, -1, 2.5, True])
def test_store_refuses_a_band_count_that_is_not_a_positive_int(bands):
    """Named at construction (a negative count used to fail at the first write, allocating a negative dimension)."""
    with pytest.raises(ValueError, match="bands must be an int >= 1"):
        LayerStore(0, get("int8"), get("int8"), bands=bands, pairing="rotate_half", seed=1)


def test_store_refuses_an_unknown_pairing_at_construction():
    """Named before the first write (it used to surface there)."""
    with pytest.raises(ValueError, match="pairing must be one of"):
        LayerStore(0, get("int8"), get("int8"), bands=8, pairing="interleave", seed=1)  # type: ignore[arg-type]


def test_emptied_store_keeps_every_setting_and_holds_nothing():
    """A cache reset starts from ``emptied()``: the same layer, codecs and settings (exact sinks included), no tokens,
    and the same writes then store the same codes."""
    gen = torch.Generator().manual_seed(2)
    st = LayerStore(
        3, get("dither-int6"), get("int4"), bands=4, pairing="rotate_half", seed=7, write_block=4,
        device_budget=0.5, witness="f32", exact_sinks=2,
    )  # fmt: skip
    k, v = torch.randn(1, 2, 12, 64, generator=gen), torch.randn(1, 2, 12, 64, generator=gen)
    st.append(k, v, torch.arange(1), torch.zeros(1, dtype=torch.bool))
    fresh = st.emptied()
    kept = ("layer", "key_codec", "value_codec", "bands", "pairing", "seed", "write_block", "device_budget")
    assert all(getattr(fresh, a) == getattr(st, a) for a in (*kept, "witness", "exact_sinks"))
    assert (st.exact_sinks, st.device_budget, st.witness) == (2, 0.5, "f32")  # the non-defaults are kept
    assert fresh.n == 0 and fresh.k is None and st.n == 12
    fresh.append(k, v, torch.arange(1), torch.zeros(1, dtype=torch.bool))
    assert torch.equal(fresh.k.served.view(), st.k.served.view())


def test_promote_encodes_host_tokens_at_their_own_positions_with_valid_witnesses():
    """Promoted tokens get the codes a write would give them, their own logical positions (per head) and witnesses
    that bound their residuals; ``appended`` does not move; a dithered codec is refused."""
    st = _store()
    k, v = _kv(t=12)
    st.append(k, v, *_rows())
    st.append(*_kv(t=1, seed=5), *_rows())
    st.gather(torch.tensor([0, 3, 7, 12]).expand(2, 3, 4).contiguous(), retain_evicted=True)
    ev = st.evicted
    pick = torch.tensor([[1, 4], [2, 8], [5, 6]]).expand(2, 3, 2).contiguous()  # archive slots, per head
    pk = ev["k"].view().gather(2, pick[..., None].expand(-1, -1, -1, 64))
    pv = ev["v"].view().gather(2, pick[..., None].expand(-1, -1, -1, 64))
    pos = ev["positions"].view().gather(2, pick)
    appended = st.appended
    st.promote(pk, pv, pos)
    assert st.n == 6 and st.appended == appended and torch.equal(st.positions.view()[..., 4:], pos)
    assert not bool(st.k.exact.view().any())  # encoded at once, nothing pending
    fresh = _store()
    fresh.append(pk, pv, *_rows())
    fresh.encode_pending(flush=True)
    assert torch.equal(st.k.served.view()[..., 4:, :], fresh.k.served.view())  # the codes a write gives
    _assert_norm_witnesses(st)
    dither = LayerStore(0, get("dither-int8"), get("int4"), bands=8, pairing="rotate_half", seed=1)
    dither.append(k, v, *_rows())
    with pytest.raises(ValueError, match="dither"):
        dither.promote(pk, pv, pos)


def _store_state(st: LayerStore) -> dict[str, torch.Tensor | int]:
    """Every buffer's live elements (as raw bytes), every ``log8`` base and the counters of a store."""
    state: dict[str, torch.Tensor | int] = {}
    for name in ("k_band", "k_wit", "k_hat_norm", "v_res", "v_hat_norm", "v_dist", "positions", "k_steps"):
        buf = getattr(st, name)
        if isinstance(buf, LogBuffer):
            state[f"{name}.codes"] = buf.codes.view().clone()
            state[f"{name}.base"] = buf.base.clone()
            state[f"{name}.rebases"] = buf.rebases
        if buf is not None:
            state[name] = buf.view().clone()
    for tag, ts in (("k", st.k), ("v", st.v)):
        assert ts is not None
        for part in ("host", "served", "exact", "held"):
            state[f"{tag}.{part}"] = getattr(ts, part).view().clone()
        state[f"{tag}.n_exact"] = ts.n_exact
        state[f"{tag}.n_encoded"] = ts.n_encoded
    for name in ("n_held", "nonfinite", "fail_closed", "appended"):
        state[name] = getattr(st, name)
    return state


@pytest.mark.parametrize("keys", ["dither-int8", "int8"])
def test_fused_pending_append_stores_what_the_general_path_stores(keys, monkeypatch):
    """On the numba backend a pending append goes through one fused kernel and numpy copies
    (:meth:`LayerStore._append_pending_fused`); every buffer (host and served K/V, flags, positions, each residual
    witness's codes, bases and decoded values, the served norms, the Tier-B steps) and every count equal, element
    for element, those of the same appends with the fused path switched off: decode tokens and multi-token appends,
    block encodes in between, large norms, non-finite tokens (their norms ``+inf``); and so do the witnesses of
    persistent repairs (:meth:`LayerStore._exact_witnesses_fused`)."""
    monkeypatch.setenv(kernel_env.ENV, "numba")
    gen = torch.Generator().manual_seed(23)
    stores = {
        fused: LayerStore(0, get(keys), get("int4"), bands=8, pairing="rotate_half", seed=5, write_block=4)
        for fused in (True, False)
    }
    taken = {(name, done): 0 for name in ("_append_pending_fused", "_exact_witnesses_fused") for done in (True, False)}

    def spy(name):
        fused = getattr(LayerStore, name)

        def call(self, *args):
            if self is stores[False]:
                return False
            done = fused(self, *args)
            taken[name, done] += 1
            return done

        return call

    for name in ("_append_pending_fused", "_exact_witnesses_fused"):
        monkeypatch.setattr(LayerStore, name, spy(name))
    rows, keep = torch.arange(2), torch.zeros(2, dtype=torch.bool)
    for step in range(40):
        t = 6 if step == 0 else (3 if step % 9 == 4 else 1)
        k, v = torch.randn(2, 3, t, 64, generator=gen), torch.randn(2, 3, t, 64, generator=gen)
        if step in (12, 30):
            k = k * 2.0**20  # large served norms (float32 in either format: no base to raise)
        if step == 17:
            v[1, 2, 0, 5] = math.nan  # kept exact, its norms +inf
        for st in stores.values():
            st.append(k, v, rows, keep)
            if step in (8, 21, 33, 36):
                st.persist(0, 1, slice(0, 4 + step))  # some of them already held exact
                st.persist_heads([(1, 2), (0, 0)], [slice(2, 9), torch.arange(st.n) % 5 == 0])
            if step == 36:
                st.persist(1, 1, slice(0, 12))  # large served norms at 12 and 30
        got, want = _store_state(stores[True]), _store_state(stores[False])
        assert got.keys() == want.keys()
        for name, w in want.items():
            g = got[name]
            if isinstance(w, torch.Tensor):
                assert g.shape == w.shape and g.dtype == w.dtype, name
                assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), (step, name)
            else:
                assert g == w, (step, name)
    assert taken["_append_pending_fused", True] == 40 and taken["_append_pending_fused", False] == 0
    assert taken["_exact_witnesses_fused", True] >= 4 and taken["_exact_witnesses_fused", False] == 0


def test_fused_pending_append_is_numba_only(monkeypatch):
    """Under ``KVCERT_KERNEL=torch`` (the tensor path a CUDA cache runs) the fused path records nothing."""
    monkeypatch.setenv(kernel_env.ENV, "torch")
    st = _store()
    k, v = _kv()
    st.append(k, v, *_rows())
    writes = WriteBatch()
    assert not st._append_pending_fused(k[:, :, :1], v[:, :, :1], st.positions.view()[:, :, :1], writes)
    assert writes.commit() == {}


@pytest.mark.parametrize(("keys", "values"), [("dither-int8", "int4"), ("dither-int6", "int2"), ("int8", "int4")])
def test_fused_block_round_trip_stores_what_encode_then_decode_stores(keys, values, monkeypatch):
    """On the numba backend a dithered or RTN write block is encoded and decoded in one compiled pass
    (:meth:`~kvcert.quant.base.Codec.encode_decode`); every buffer, base and count of the store, and the
    codes and steps of every chunk, equal per element those of the same writes encoded then decoded on the tensor
    form (``Codec._encode_decode``): decode tokens and multi-token appends, a token with a non-finite entry (kept
    exact), exact sinks, magnitudes that raise a witness base."""
    from kvcert.quant.base import Codec
    from kvcert.quant.dither import DitherCodec
    from kvcert.quant.rtn import RTNCodec

    monkeypatch.setenv(kernel_env.ENV, "numba")
    gen = torch.Generator().manual_seed(31)
    stores = {
        fused: LayerStore(
            0, get(keys), get(values), bands=8, pairing="rotate_half", seed=9, write_block=4, exact_sinks=2
        )
        for fused in (True, False)
    }
    reference = (stores[False].key_codec, stores[False].value_codec)
    fused_calls: list[tuple[str, int]] = []

    def spy(cls):
        round_trip = cls._encode_decode

        def call(self, x, key):
            if any(self is codec for codec in reference):
                return Codec._encode_decode(self, x, key)
            fused_calls.append((self.name, x.shape[2]))
            return round_trip(self, x, key)

        return call

    for cls in (DitherCodec, RTNCodec):
        monkeypatch.setattr(cls, "_encode_decode", spy(cls))
    rows, keep = torch.arange(2), torch.zeros(2, dtype=torch.bool)
    for step in range(30):
        t = 7 if step == 0 else (3 if step % 7 == 3 else 1)
        k, v = torch.randn(2, 3, t, 64, generator=gen), torch.randn(2, 3, t, 64, generator=gen)
        if step == 11:
            k = k * 2.0**10  # (the int6 steps stay within fp16)
        if step == 15:
            k[0, 1, 0, 7] = math.inf
        for st in stores.values():
            st.append(k, v, rows, keep)
        got, want = _store_state(stores[True]), _store_state(stores[False])
        assert got.keys() == want.keys()
        for name, w in want.items():
            g = got[name]
            if isinstance(w, torch.Tensor):
                assert g.dtype == w.dtype and torch.equal(
                    g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)
                )
            else:
                assert g == w, (step, name)
    for tensor in ("k", "v"):
        chunks = [getattr(st, tensor).chunks for st in (stores[True], stores[False])]
        assert len(chunks[0]) == len(chunks[1]) >= 8
        for a, b in zip(*chunks, strict=True):
            assert (a.start, a.stop) == (b.start, b.stop)
            assert all(torch.equal(a.packed.tensors[n], b.packed.tensors[n]) for n in b.packed.tensors)
    for name, ts in ((keys, stores[True].k), (values, stores[True].v)):
        assert sum(t for codec, t in fused_calls if codec == name) == ts.n_encoded
    assert stores[True].k_band.rebases > 0
