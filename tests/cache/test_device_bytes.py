"""Device-tier byte accounting and the device budget of LayerStore (persist / transient / release)."""

from __future__ import annotations

import pytest
import torch

from kvcert.bounds.rope import norm_up_f32
from kvcert.cache.buffer import WriteBatch
from kvcert.cache.store import LayerStore
from kvcert.quant import get
from kvcert.quant.dither import DitherCodec
from kvcert.quant.per_head import PerHeadCodec


def _store(keys="int8", values="int4", budget=None, write_block=1, witness="log8", **kw):
    return LayerStore(
        0,
        get(keys, **kw),
        get(values, **({"axis": "value"} if values.startswith("kivi") else {})),
        bands=8,
        pairing="rotate_half",
        seed=1,
        write_block=write_block,
        device_budget=budget,
        witness=witness,
    )


def _kv(b=2, h=3, t=10, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)


def _rows(b=2):
    return torch.arange(b), torch.zeros(b, dtype=torch.bool)


def walk_device_bytes(st: LayerStore) -> int:
    """Σ nbytes of the tensors the device tier holds, walked one by one (independent of bytes_device()):
    every packed chunk and upgrade record tensor, every stored witness buffer's live prefix (``"f32"``: the float32
    values, the served norms, ``k_wit`` and the steps included; ``"log8"``: the uint8 codes and base exponents of
    the residual witnesses, the served norms, ``k_wit`` and the steps being derived), the value centre, and the
    entries held exact, materialised at 16 bits from the exact originals."""
    total = 0
    for ts in (st.k, st.v):
        for packed in [c.packed for c in ts.chunks] + [u.packed for u in ts.upgrades]:
            total += sum(t.nbytes for t in packed.tensors.values())
        total += ts.host.view()[ts.exact.view()].to(torch.float16).nbytes
    stored = (st.k_band, st.v_res)
    if st.witness == "f32":
        for buf in (*stored, st.k_hat_norm, st.v_hat_norm, st.v_dist, st.k_wit, st.k_steps):
            if buf is not None:
                total += buf.view().nbytes
    else:
        for buf in stored:
            assert buf.codes.view().dtype == torch.uint8
            total += buf.codes.view().nbytes + buf.base.nbytes
    return total + st.v_centre.nbytes


def _witness_state(st: LayerStore) -> dict[str, torch.Tensor]:
    bufs = {
        "k_band": st.k_band,
        "k_wit": st.k_wit,
        "k_hat_norm": st.k_hat_norm,
        "v_res": st.v_res,
        "v_hat_norm": st.v_hat_norm,
        "v_dist": st.v_dist,
        "k_served": st.k.served,
        "v_served": st.v.served,
        "k_exact": st.k.exact,
        "v_exact": st.v.exact,
    }
    if st.k_steps is not None:
        bufs["k_steps"] = st.k_steps
    return {name: buf.view().clone() for name, buf in bufs.items()}


@pytest.mark.parametrize("witness", ["f32", "log8"])
@pytest.mark.parametrize(
    "keys,values",
    [
        ("int8", "int4"),
        ("int2", "int2"),
        ("dither-int8", "int4"),
        ("dither-int4", "int4"),
        ("dither-int3", "int2"),
        ("kivi-2", "kivi-2"),
        ("fp8-e4m3", "int8"),
    ],
)
def test_bytes_device_is_the_sum_of_the_stored_tensors(keys, values, witness):
    kw = {"axis": "key"} if keys.startswith("kivi") else {}
    st = _store(keys, values, witness=witness, **kw)
    st.append(*_kv(t=70), *_rows())
    st.append(*_kv(t=1, seed=1), *_rows())
    assert st.bytes_device() == walk_device_bytes(st) > 0
    assert st.bytes_device() == st.bytes_stored() + st.bytes_witness()
    parts = st.device_bytes_by_part()
    assert sum(parts.values()) == st.bytes_device() and parts["witnesses"] == st.bytes_witness()
    pending = (st.k.host.n - st.k.n_encoded) * 2 * 3 * 64 * 2  # the tail not yet encoded, 16 bits, every (row, head)
    assert parts["k exact, not yet encoded"] == pending and parts["k exact, held"] == 0
    st.make_exact(1, 2, slice(3, 40))  # repaired entries add 16-bit copies, codes stay
    assert st.bytes_device() == walk_device_bytes(st)
    parts = st.device_bytes_by_part()
    assert sum(parts.values()) == st.bytes_device()
    for t, ts in (("k", st.k), ("v", st.v)):  # slots 3..39 of one head, less those still pending (exact already)
        assert parts[f"{t} exact, held"] == (min(40, ts.n_encoded) - 3) * 64 * 2
    st.append(*_kv(t=3, seed=2), *_rows())
    st.drop_before(20)  # sliding trim frees whole chunks
    assert st.bytes_device() == walk_device_bytes(st)
    assert st.bytes_fp16() == (st.k.host.view().numel() + st.v.host.view().numel()) * 2 > 0
    assert st.n_held == sum(int(ts.held.view().sum()) for ts in (st.k, st.v)) > 0


@pytest.mark.parametrize("witness", ["f32", "log8"])
def test_bytes_device_after_eviction_gather(witness):
    st = _store("int8", "int8", witness=witness)
    st.append(*_kv(t=20), *_rows())
    st.append(*_kv(t=1, seed=1), *_rows())
    st.make_exact(0, 1, slice(2, 9))
    st.gather(torch.tensor([0, 2, 5, 7, 15]).expand(2, 3, 5).contiguous())
    assert st.bytes_device() == walk_device_bytes(st)


@pytest.mark.parametrize("witness", ["f32", "log8"])
def test_mixed_width_keys_bytes_and_gather_per_head(witness):
    """``dither-mixed`` keys (a width per KV head) and ``mixed[...]`` values (a codec per KV head): the device bytes
    are the stored tensors', and an eviction gather that keeps different tokens per head keeps each head's codes
    from its own width or member group."""
    codec, vcodec = DitherCodec(head_bits=(8, 3, 5)), PerHeadCodec(("int4", "int2", "int8"))
    st = LayerStore(0, codec, vcodec, bands=8, pairing="rotate_half", seed=1, write_block=1, witness=witness)
    st.append(*_kv(t=20), *_rows())
    st.append(*_kv(t=1, seed=1), *_rows())
    assert st.bytes_device() == walk_device_bytes(st) > 0
    before = torch.cat([codec.codes(c.packed) for c in st.k.chunks], dim=2)
    before_v = torch.cat([vcodec.decode(c.packed) for c in st.v.chunks], dim=2)
    keep = torch.stack(
        [torch.tensor([0, 2, 5, 7, 15]), torch.tensor([1, 3, 4, 9, 19]), torch.tensor([0, 6, 8, 10, 11])]
    )
    keep = keep.expand(2, 3, 5).contiguous()
    st.gather(keep)
    assert st.bytes_device() == walk_device_bytes(st)
    after = torch.cat([codec.codes(c.packed) for c in st.k.chunks], dim=2)
    assert torch.equal(after, torch.gather(before, 2, keep.unsqueeze(-1).expand(2, 3, 5, 64)))
    after_v = torch.cat([vcodec.decode(c.packed) for c in st.v.chunks], dim=2)
    assert torch.equal(after_v, torch.gather(before_v, 2, keep.unsqueeze(-1).expand(2, 3, 5, 64)))


def test_persist_never_exceeds_the_budget_and_counts_transient_page_ins():
    budget = 0.8
    st = _store("int2", "int2", budget=budget)
    st.append(*_kv(t=64), *_rows())
    st.append(*_kv(t=1, seed=1), *_rows())
    floor = st.bytes_device()
    assert floor <= budget * st.bytes_fp16()
    kept = []
    for b in range(2):
        for h in range(3):
            kept.append(st.persist(b, h, slice(0, st.n)))
            assert st.bytes_device() <= budget * st.bytes_fp16()
            assert st.bytes_device() == walk_device_bytes(st)
    assert any(kept) and not all(kept)  # the budget binds part way through
    assert st.transient_repairs == kept.count(False)
    assert st.bytes_transient == kept.count(False) * st.n * (64 + 64) * 4  # float32 host tier here
    unlimited = _store("int2", "int2")
    unlimited.append(*_kv(t=64), *_rows())
    unlimited.append(*_kv(t=1, seed=1), *_rows())
    for b in range(2):
        for h in range(3):
            assert unlimited.persist(b, h, slice(0, unlimited.n))
    assert unlimited.bytes_device() > unlimited.bytes_fp16()  # without a budget int2 + repair exceeds fp16


@pytest.mark.parametrize("witness", ["f32", "log8"])
def test_release_restores_codes_and_witnesses_exactly(witness):
    """A held repair released by the budget serves its codes again with the very witnesses of encode time."""
    st = _store("dither-int8", "int4", budget=10.0, write_block=16, witness=witness)
    st.append(*_kv(t=64), *_rows())
    st.append(*_kv(t=1, seed=1), *_rows())
    before = _witness_state(st)
    assert st.persist(0, 1, slice(0, 64)) and st.persist(1, 2, torch.arange(st.n) % 3 == 0)
    assert st.held_heads()[0, 1] and st.held_heads()[1, 2] and not st.held_heads()[0, 0]
    st.device_budget = 1e-6  # the next write must release everything held
    st.append(*_kv(t=1, seed=2), *_rows())
    assert not st.held_heads().any() and st.released > 0
    after = _witness_state(st)
    for name, old in before.items():
        assert torch.equal(after[name][:, :, : old.shape[2]], old), name


def test_release_runs_on_write_until_under_budget():
    """After every write the store holds bytes_device <= max(budget, floor): the floor is what it holds with
    no repair kept (codes, witnesses, pending entries)."""
    budget = 0.6
    st = _store("int2", "int2", budget=budget, write_block=4)
    st.append(*_kv(t=32), *_rows())
    for step in range(12):
        st.append(*_kv(t=1, seed=10 + step), *_rows())
        limit = budget * st.bytes_fp16()
        held = sum(int(ts.held.view().sum()) for ts in (st.k, st.v))
        floor = st.bytes_device() - held * 64 * 2
        assert st.bytes_device() <= max(limit, floor)
        for b in range(2):
            st.persist(b, step % 3, slice(0, st.n))
            assert st.bytes_device() <= max(budget * st.bytes_fp16(), floor)


def _assert_exact_counted(st: LayerStore) -> None:
    """The running counts and the remembered held heads equal what the flags give now."""
    for ts in (st.k, st.v):
        assert ts.n_exact == int(ts.exact.view().sum())
    assert torch.equal(st.held_heads(), st.k.held.view().any(-1) | st.v.held.view().any(-1))


@pytest.mark.parametrize("witness", ["f32", "log8"])
def test_exact_count_follows_the_flags(witness):
    """The running count of entries held exact (what every budget check reads) equals the flags' sum, and the
    held heads (remembered between changes) equal the held flags' reduction, after every kind of change: pending
    appends, block encodes (non-finite entries and fail-closed rows kept exact), holds, budget releases, a sliding
    trim and an eviction."""
    bad = _store("int8", "int4", write_block=4, witness=witness)
    k, v = _kv(t=20)
    k[0, 1, 3, 5] = float("nan")  # kept exact at its encode
    bad.append(k, v, torch.arange(2), torch.tensor([False, True]))  # row 1: fail closed, never compressed
    bad.append(*_kv(t=1, seed=1), torch.arange(2), torch.tensor([False, True]))
    assert bad.nonfinite > 0 and bad.fail_closed > 0
    _assert_exact_counted(bad)
    st = _store("int8", "int4", budget=0.9, write_block=4, witness=witness)
    st.append(*_kv(t=20), *_rows())
    _assert_exact_counted(st)
    for step in range(10):
        st.append(*_kv(t=1, seed=20 + step), *_rows())
        _assert_exact_counted(st)
        st.persist(step % 2, step % 3, torch.arange(st.n) % (step + 2) == 0)
        _assert_exact_counted(st)
    assert st.n_held > 0
    st.device_budget = 1e-6  # the next write releases every hold
    st.append(*_kv(t=1, seed=40), *_rows())
    assert st.released > 0
    _assert_exact_counted(st)
    st.drop_before(5)
    _assert_exact_counted(st)
    ev = _store("int8", "int8", witness=witness)
    ev.append(*_kv(t=20), *_rows())
    ev.append(*_kv(t=1, seed=1), *_rows())
    ev.make_exact(0, 1, slice(2, 9))
    ev.gather(torch.tensor([0, 2, 5, 7, 15]).expand(2, 3, 5).contiguous())
    _assert_exact_counted(ev)


def test_budget_rejects_non_positive():
    with pytest.raises(ValueError, match="device_budget"):
        _store(budget=0.0)


def _full_state(st: LayerStore) -> dict[str, torch.Tensor]:
    """Every witness (log8: codes and bases too), served entry and exact / held flag, and the counters."""
    state = _witness_state(st)
    for name in ("k_band", "k_hat_norm", "v_res", "v_hat_norm", "v_dist"):
        buf = getattr(st, name)
        if hasattr(buf, "codes"):
            state[name + ".codes"], state[name + ".base"] = buf.codes.view().clone(), buf.base.clone()
    state["k_held"], state["v_held"] = st.k.held.view().clone(), st.v.held.view().clone()
    for name in ("n_held", "transient_repairs", "bytes_transient"):
        state[name] = torch.tensor(getattr(st, name))
    return state


def _make_exact_head_by_head(st: LayerStore, b: int, h: int, tokens) -> None:
    """The reference: make_exact as it was before the witnesses of several heads shared one write, the served
    entries and flags of (b, h) set, then its witnesses written at ``(b, h, tokens)`` and committed alone."""
    for ts in (st.k, st.v):
        ts.served.view()[b, h, tokens] = ts.host.view()[b, h, tokens].to(torch.float32)
        newly = ~ts.exact.view()[b, h, tokens]
        ts.held.view()[b, h, tokens] |= newly
        st.n_held += int(newly.sum())
        ts.add_exact(int(newly.sum()))
        ts.exact.view()[b, h, tokens] = True
    exact_v = st.v.served.view()[b, h, tokens]
    wit = {
        "k_band": 0.0,
        "k_wit": 0.0,
        "v_res": 0.0,
        "k_hat_norm": norm_up_f32(st.k.served.view()[b, h, tokens]),
        "v_hat_norm": norm_up_f32(exact_v),
        "v_dist": norm_up_f32(exact_v.to(torch.float64) - st.v_centre[b, h]),
    }
    if st.k_steps is not None:
        wit["k_steps"] = 0.0
    writes = WriteBatch()
    st._write_witnesses((b, h, tokens), wit, writes)
    st._commit(writes)


@pytest.mark.parametrize("witness", ["f32", "log8"])
@pytest.mark.parametrize("budget", [None, 0.8])
def test_persist_heads_is_persist_head_by_head(witness, budget):
    """One witness write per buffer for several heads leaves every element, code, base and counter as the former
    make_exact head by head (one commit each) does, and as persist head by head does (under a budget that binds
    part way through: each check sees the heads kept before it)."""
    heads = [(0, 1), (1, 0), (0, 2), (1, 2), (0, 0), (1, 1)]
    masks = [torch.arange(65) % (j + 2) != 0 for j in range(len(heads))]

    def build():
        st = _store("int2", "int2", budget=budget, witness=witness)
        st.append(*_kv(t=64), *_rows())
        st.append(*_kv(t=1, seed=1), *_rows())
        return st

    one_by_one, batched, reference = build(), build(), build()
    kept = [one_by_one.persist(b, h, m) for (b, h), m in zip(heads, masks, strict=True)]
    assert batched.persist_heads(heads, masks) == kept
    if budget is not None:
        assert any(kept) and not all(kept)  # the budget binds part way through
    for (b, h), m, k in zip(heads, masks, kept, strict=True):
        if k:
            _make_exact_head_by_head(reference, b, h, m)
    reference.transient_repairs, reference.bytes_transient = one_by_one.transient_repairs, one_by_one.bytes_transient
    want = _full_state(reference)
    for st in (one_by_one, batched):
        got = _full_state(st)
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
    with pytest.raises(ValueError, match="2 heads but 1"):
        batched.persist_heads(heads[:2], masks[:1])
