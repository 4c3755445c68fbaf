"""LogBuffer (8-bit witness storage) and the "log8" witness storage of LayerStore: every decoded witness is at
least the float32 witness the same writes give under "f32" (per element), zeros stay zero, and the derived key
witness bounds the decoded bands' sum."""

from __future__ import annotations

import pytest
import torch

from kvcert.cache.buffer import GrowBuffer, LogBuffer, TokenIndex, WriteBatch
from kvcert.cache.store import SERVED_NORMS, STORED_WITNESSES, LayerStore, band_sum_up
from kvcert.checks import deferred, fail_if
from kvcert.quant import get, kernel_env, logcode


def test_log_buffer_append_write_rebase_gather_trim():
    gen = torch.Generator().manual_seed(0)
    buf = LogBuffer(torch.zeros(2, 3, 0, 4))
    x = torch.rand(2, 3, 9, 4, generator=gen) * 10
    x[0, 0] = 0.0  # a head that has only seen zeros keeps no base
    buf.append(x)
    assert (buf.view() >= x).all() and (buf.view()[0, 0] == 0).all()
    assert int(buf.base[0, 0]) == torch.iinfo(torch.int32).min
    assert buf.codes.view().dtype == torch.uint8 and buf.nbytes == 2 * 3 * 9 * 4 + 2 * 3 * 4
    big = torch.full((2, 3, 1, 4), 1e7)  # far above the first write's top code: the bases rise
    buf.append(big)
    assert buf.rebases > 0 and (buf.view()[:, :, :9] >= x).all() and (buf.view()[:, :, 9:] >= big).all()
    buf.write((1, 2, slice(0, 3)), 0.0)
    assert (buf.view()[1, 2, :3] == 0).all()
    mask = torch.tensor([True, False] * 5)
    buf.write((0, 1, mask), torch.tensor(3.0, dtype=torch.float64))
    assert (buf.view()[0, 1, mask] >= 3.0).all()
    keep = torch.tensor([1, 4, 9]).expand(2, 3, 3).contiguous()
    kept = buf.view().gather(2, keep.unsqueeze(-1).expand(2, 3, 3, 4)).clone()
    buf.gather(keep)
    assert torch.equal(buf.view(), kept)
    buf.drop_before(1)
    assert torch.equal(buf.view(), kept[:, :, 1:]) and buf.n == 2
    assert buf.array().shape[2] >= buf.n  # the decoded allocation the fused kernels read


def _pair(keys: str, values: str, **kw):
    def make(witness: str) -> LayerStore:
        return LayerStore(0, get(keys), get(values), bands=8, pairing="rotate_half", seed=3, witness=witness, **kw)

    return make("f32"), make("log8")


@pytest.mark.parametrize(
    "keys,values", [("dither-int8", "int4"), ("int4", "int2"), ("kivi-2", "int8"), ("none", "none")]
)
def test_log8_witnesses_dominate_f32_per_element(keys, values):
    """Same writes into an "f32" and a "log8" store: every served witness of log8 is >= the f32 one (which is
    >= the true value), exactly 0 where f32 is 0; k_wit is band_sum_up of the decoded bands; the served K/V
    are identical (the witness format never changes what is served)."""
    if keys == "kivi-2":
        f32, log8 = (
            LayerStore(0, get("kivi-2", axis="key"), get(values), bands=8, pairing="rotate_half", seed=3, witness=w)
            for w in ("f32", "log8")
        )
    else:
        f32, log8 = _pair(keys, values, write_block=16)
    gen = torch.Generator().manual_seed(1)
    rows, keep = torch.arange(2), torch.zeros(2, dtype=torch.bool)
    for t in (70, 1, 1, 33, 1):
        k = torch.randn(2, 3, t, 64, generator=gen) * torch.rand(2, 3, 1, 1, generator=gen) * 20
        v = torch.randn(2, 3, t, 64, generator=gen)
        for st in (f32, log8):
            st.append(k, v, rows, keep)
    log8.make_exact(1, 2, slice(3, 40))
    f32.make_exact(1, 2, slice(3, 40))
    assert torch.equal(f32.k.served.view(), log8.k.served.view())
    for name in (*STORED_WITNESSES, "k_wit"):
        a, b = getattr(f32, name).view(), getattr(log8, name).view()
        assert (b >= a).all(), name
        assert torch.equal(a == 0, b == 0), name
    for name in SERVED_NORMS:  # float32 in both formats: the same values
        assert torch.equal(getattr(f32, name).view(), getattr(log8, name).view()), name
    assert torch.equal(log8.k_wit.view(), band_sum_up(log8.k_band.view(), 8))
    b, h = 2, 3  # 9 B per token per KV head (8 band codes + 1 value-residual code), one int32 base per head and buffer
    assert log8.bytes_witness() == 9 * log8.n * b * h + log8.v_centre.nbytes + 2 * b * h * 4
    assert log8.bytes_witness() < f32.bytes_witness() / 3


def test_log8_store_bytes_per_token():
    """9 witness bytes per token per KV head with 8 bands (plus per-head bases and the value centre); the served
    norms are derived, not counted."""
    _, st = _pair("dither-int8", "int4")
    st.append(torch.randn(1, 3, 512, 64), torch.randn(1, 3, 512, 64), torch.arange(1), torch.zeros(1, dtype=torch.bool))
    fixed = st.v_centre.nbytes + 2 * 3 * 4  # centre + two base-exponent tensors [1, 3] int32
    assert st.bytes_witness() == 512 * 3 * (8 + 1) + fixed


def test_unknown_witness_format_is_refused():
    with pytest.raises(ValueError, match="witness"):
        LayerStore(0, get("int8"), get("int8"), bands=8, pairing="rotate_half", seed=0, witness="f16")


def test_log_buffer_write_is_the_same_through_the_exact_search(monkeypatch):
    """A write whose exponents the device-side rounds did not settle falls back to the exact search and stores
    what a settled write stores (codes, bases, decoded values); a negative witness is refused before anything is
    stored."""
    monkeypatch.setenv(kernel_env.ENV, "torch")  # the tensor path: the fused CPU plan searches exactly
    gen = torch.Generator().manual_seed(4)
    n = torch.randint(-60, 60, (2, 3, 5, 4), generator=gen, dtype=torch.int32)
    x = logcode.dec(n).to(torch.float64)  # codes' own values: the float64 log2 guess is one code too high
    settled = LogBuffer(torch.zeros(2, 3, 0, 4))
    settled.append(x)
    monkeypatch.setattr(logcode, "SETTLE_ROUNDS", 0)
    assert bool(logcode.exponent_settle(x)[1])  # this write takes the fallback
    fallback = LogBuffer(torch.zeros(2, 3, 0, 4))
    fallback.append(x)
    assert torch.equal(fallback.codes.view(), settled.codes.view()) and torch.equal(fallback.base, settled.base)
    assert torch.equal(fallback.view(), settled.view())
    before = (fallback.codes.view().clone(), fallback.base.clone())
    with pytest.raises(ValueError, match="non-negative"):
        fallback.write((0, 0, slice(0, 1)), -1.0)
    assert torch.equal(fallback.codes.view(), before[0]) and torch.equal(fallback.base, before[1])
    unsettled = x.clone()
    unsettled[1, 2, 3, 0] = -1.0  # a negative witness in a write whose exponents take the exact search
    assert bool(logcode.exponent_settle(unsettled)[1])
    with pytest.raises(ValueError, match="non-negative"):
        fallback.write((slice(None), slice(None), slice(0, 5)), unsettled)
    assert torch.equal(fallback.codes.view(), before[0]) and torch.equal(fallback.base, before[1])


def _same(a: LogBuffer, b: LogBuffer) -> bool:
    """Identical stored codes, bases, decoded values and rebase counts."""
    return (
        torch.equal(a.codes.view(), b.codes.view())
        and torch.equal(a.base, b.base)
        and torch.equal(a.view(), b.view())
        and a.rebases == b.rebases
    )


def _three(gen: torch.Generator) -> list[LogBuffer]:
    """Three buffers with one write each already stored (so later writes may raise their bases or not)."""
    bufs = [LogBuffer(torch.zeros(2, 3, 0, *tail)) for tail in ((4,), (), (4,))]
    for buf in bufs:
        buf.append(torch.rand(*buf.shape[:2], 6, *buf.shape[3:], generator=gen) * 10)
    return bufs


def _writes(gen: torch.Generator, bufs: list[LogBuffer]) -> list[tuple[LogBuffer, TokenIndex, torch.Tensor]]:
    """Writes to ``bufs``: the first raises some of its bases (one head far above its top code), the second
    none; the third takes two writes, the second of which raises a base."""
    big = torch.rand(2, 3, 2, 4, generator=gen)
    big[1, 2] = 1e7
    small = torch.rand(2, 3, 3, generator=gen)
    mid = torch.rand(2, 3, 1, 4, generator=gen) * 5
    huge = torch.full((1, 4), 1e9)
    return [
        (bufs[0], (slice(None), slice(None), slice(1, 3)), big),
        (bufs[1], (slice(None), slice(None), slice(2, 5)), small),
        (bufs[2], (slice(None), slice(None), slice(0, 1)), mid),
        (bufs[2], (0, 1, slice(4, 5)), huge),
    ]


def test_write_batch_stores_what_per_buffer_writes_store():
    """One batched commit (one read-back) gives the codes, bases, decoded values and rebase counts of the same
    writes made one by one, where some bases rise and others do not, and reports which buffers' bases rose."""
    one, batched = _three(torch.Generator().manual_seed(5)), _three(torch.Generator().manual_seed(5))
    raised = [buf.write(index, x) for buf, index, x in _writes(torch.Generator().manual_seed(6), one)]
    assert raised == [True, False, False, True]
    writes = WriteBatch()
    for buf, index, x in _writes(torch.Generator().manual_seed(6), batched):
        writes.write(buf, index, x)
    writes.commit()
    assert writes.raised == {batched[0], batched[2]}
    assert all(_same(a, b) for a, b in zip(one, batched, strict=True))
    appended = torch.rand(2, 3, 2, 4, generator=torch.Generator().manual_seed(7)) * 1e8
    one[0].append(appended)
    writes.append(batched[0], appended)
    writes.commit()
    assert _same(one[0], batched[0]) and batched[0] in writes.raised


def test_write_batch_refused_leaves_every_buffer_unchanged():
    """A negative witness in one write of a batch raises the same ValueError as a single write and stores none
    of the batch's writes (nor its appends, nor its other state changes)."""
    bufs = _three(torch.Generator().manual_seed(8))
    before = [(b.codes.view().clone(), b.base.clone(), b.view().clone(), b.n) for b in bufs]
    writes = WriteBatch()
    changed = []
    for buf, index, x in _writes(torch.Generator().manual_seed(9), bufs)[:3]:
        writes.write(buf, index, x)
    writes.append(bufs[1], torch.ones(2, 3, 1))
    writes.then(lambda: changed.append(1))
    writes.write(bufs[2], (1, 1, slice(0, 2)), torch.tensor([[0.5], [-1.0]]))
    with pytest.raises(ValueError, match="non-negative"):
        writes.commit()
    for buf, (codes, base, decoded, n) in zip(bufs, before, strict=True):
        assert buf.n == n and torch.equal(buf.codes.view(), codes) and torch.equal(buf.base, base)
        assert torch.equal(buf.view(), decoded)
    assert not changed


def test_write_batch_raises_the_first_failed_deferred_check_and_stores_nothing():
    """A codec check deferred into the batch (:func:`kvcert.checks.fail_if` inside :func:`deferred`) raises its
    own error at the commit, the first failed one in order, and nothing recorded is stored."""
    buf = LogBuffer(torch.zeros(1, 1, 0))
    writes = WriteBatch()
    with deferred(writes.require):
        fail_if(torch.tensor(False), lambda: ValueError("never"))
        fail_if(torch.tensor(True), lambda: ValueError("first"))
        fail_if(torch.tensor(True), lambda: ValueError("second"))
    writes.append(buf, torch.ones(1, 1, 2))
    with pytest.raises(ValueError, match="first"):
        writes.commit()
    assert buf.n == 0
    with pytest.raises(ValueError, match="now"):  # outside a deferred block a check reads back at once
        fail_if(torch.tensor(True), lambda: ValueError("now"))


def test_write_batch_counts_and_refuses_a_write_after_an_append():
    writes = WriteBatch()
    buf = LogBuffer(torch.zeros(1, 2, 0))
    writes.count("n", torch.tensor(2))
    writes.count("n", torch.tensor(3))
    writes.append(buf, torch.ones(1, 2, 1))
    with pytest.raises(ValueError, match="commit in between"):
        writes.write(buf, (0, 0, slice(0, 1)), 1.0)
    assert writes.commit() == {"n": 5} and buf.n == 1


def test_write_batch_fallback_matches_per_buffer_writes(monkeypatch):
    """Batched writes whose exponents the device-side rounds did not settle (codes' own values: the float64 log2
    guess is one code off) take the exact search and store what settled per-buffer writes store."""
    monkeypatch.setenv(kernel_env.ENV, "torch")  # the tensor path: the fused CPU plan searches exactly
    gen = torch.Generator().manual_seed(10)
    values = [
        logcode.dec(torch.randint(-60, 60, shape, generator=gen, dtype=torch.int32)).to(torch.float64)
        for shape in ((2, 3, 5, 4), (2, 3, 5), (2, 3, 2, 4))
    ]
    settled = [LogBuffer(torch.zeros(2, 3, 0, 4)), LogBuffer(torch.zeros(2, 3, 0))]
    settled[0].append(values[0])
    settled[1].append(values[1])
    settled[0].write((slice(None), slice(None), slice(1, 3)), values[2] * 2.0**20)  # bases rise
    monkeypatch.setattr(logcode, "SETTLE_ROUNDS", 0)
    assert bool(logcode.exponent_settle(values[0])[1])
    batched = [LogBuffer(torch.zeros(2, 3, 0, 4)), LogBuffer(torch.zeros(2, 3, 0))]
    writes = WriteBatch()
    writes.append(batched[0], values[0])
    writes.append(batched[1], values[1])
    writes.commit()
    writes.write(batched[0], (slice(None), slice(None), slice(1, 3)), values[2] * 2.0**20)
    writes.commit()
    assert all(_same(a, b) for a, b in zip(settled, batched, strict=True))


@pytest.mark.parametrize("rounds", [2, 0])
def test_appends_together_store_what_appends_one_by_one_store(monkeypatch, rounds):
    """``WriteBatch.appends`` settles every buffer's exponents in one call and ``append_zeros`` plans zeros
    directly; both store exactly what one append per buffer stores (codes, bases, decoded values, rebases), with
    a base set by a first write, a base raised, a buffer untouched by zeros, and a GrowBuffer in between; with
    ``SETTLE_ROUNDS = 0`` the shared unsettled flag sends every write through the exact search, same result."""
    gen = torch.Generator().manual_seed(12)
    values = [
        logcode.dec(torch.randint(-60, 60, shape, generator=gen, dtype=torch.int32)).to(torch.float64)
        for shape in ((2, 3, 2, 4), (2, 3, 2))
    ]
    values[1][1, 2] = 1e9  # far above the first write's top code: that head's base rises
    tails = ((4,), (), ())
    one, together = _three_empty(tails), _three_empty(tails)
    for buf in (one[1], together[1]):
        buf.append(torch.rand(2, 3, 3, generator=torch.Generator().manual_seed(13)))
    grown_one, grown_together = GrowBuffer(torch.zeros(2, 3, 0)), GrowBuffer(torch.zeros(2, 3, 0))
    monkeypatch.setattr(logcode, "SETTLE_ROUNDS", rounds)
    monkeypatch.setenv(kernel_env.ENV, "torch")  # the tensor path: the fused CPU plan searches exactly
    one[0].append(values[0])
    grown_one.append(values[1].to(torch.float32))
    one[1].append(values[1])
    one[2].append(torch.zeros(2, 3, 2))
    writes = WriteBatch()
    writes.appends([(together[0], values[0]), (grown_together, values[1].to(torch.float32)), (together[1], values[1])])
    writes.append_zeros(together[2], (2, 3, 2))
    writes.commit()
    assert writes.raised == {together[1]}
    assert all(_same(a, b) for a, b in zip(one, together, strict=True))
    assert torch.equal(grown_one.view(), grown_together.view())
    assert (together[2].base == logcode.UNSET).all() and not together[2].view().any()


def _three_empty(tails: tuple[tuple[int, ...], ...]) -> list[LogBuffer]:
    return [LogBuffer(torch.zeros(2, 3, 0, *tail)) for tail in tails]


@pytest.mark.parametrize("witness", ["f32", "log8"])
def test_a_refused_store_write_changes_nothing(witness):
    """A codec check failing while a write encodes the pending block (an fp16 store given a key beyond the fp16
    range) raises its own error at the write's one read-back, and leaves every tier, witness and count as before."""
    st = LayerStore(0, get("none"), get("int4"), bands=8, pairing="rotate_half", seed=3, witness=witness)
    rows, keep = torch.arange(2), torch.zeros(2, dtype=torch.bool)
    gen = torch.Generator().manual_seed(11)
    st.append(torch.randn(2, 3, 5, 64, generator=gen), torch.randn(2, 3, 5, 64, generator=gen), rows, keep)
    big = torch.randn(2, 3, 1, 64, generator=gen)
    big[1, 2, 0, 7] = 1e6
    st.append(big, torch.randn(2, 3, 1, 64, generator=gen), rows, keep)  # pending: stored exact, not encoded yet
    names = ("k_band", "k_wit", "k_hat_norm", "v_res", "v_hat_norm", "v_dist", "positions")
    before = {name: getattr(st, name).view().clone() for name in names}
    tiers = [(ts.n_encoded, len(ts.chunks), ts.served.view().clone(), ts.exact.view().clone()) for ts in (st.k, st.v)]
    with pytest.raises(ValueError, match="fp16 range"):
        st.append(torch.randn(2, 3, 1, 64), torch.randn(2, 3, 1, 64), rows, keep)
    assert all(torch.equal(getattr(st, name).view(), before[name]) for name in names)
    for ts, (n_encoded, chunks, served, exact) in zip((st.k, st.v), tiers, strict=True):
        assert ts.n_encoded == n_encoded and len(ts.chunks) == chunks and ts.host.n == st.n == 6
        assert torch.equal(ts.served.view(), served) and torch.equal(ts.exact.view(), exact)
    assert st.nonfinite == 0 and st.appended == 6


def test_fused_cpu_writes_store_what_the_tensor_path_stores(monkeypatch):
    """The same sequence of appends and writes (whole-head token slices, a boolean mask of one head, batches of
    several buffers, bases set, raised and left unset, NaN and inf) stores the same codes, bases, decoded values
    and rebase counts after every step on the fused CPU plan as on the tensor path."""

    def run() -> list[tuple[torch.Tensor, ...]]:
        gen = torch.Generator().manual_seed(21)
        bufs = [LogBuffer(torch.zeros(2, 3, 0, 4)), LogBuffer(torch.zeros(2, 3, 0))]
        states = []
        for step in range(24):
            x = torch.rand(2, 3, 2, 4, generator=gen) * 10.0 ** int(torch.randint(-3, 9, (1,), generator=gen))
            x[0, 1] = 0.0 if step % 5 == 0 else x[0, 1]
            x[1, 1, 0, 0] = float("nan") if step == 7 else x[1, 1, 0, 0]
            writes = WriteBatch()
            writes.appends([(bufs[0], x), (bufs[1], x.sum(-1).to(torch.float64))])
            writes.commit()
            if step % 3 == 0:
                bufs[0].write((slice(None), slice(None), slice(0, 2)), torch.rand(2, 3, 2, 4, generator=gen) * 100)
            if step % 4 == 0:
                mask = torch.arange(bufs[1].n) % 2 == 0
                bufs[1].write((1, 2, mask), torch.rand(int(mask.sum()), generator=gen) * 1e5)
            states += [
                (b.codes.view().clone(), b.base.clone(), b.view().clone(), torch.tensor(b.rebases)) for b in bufs
            ]
        assert bufs[0].rebases and bufs[1].rebases  # some bases rose
        return states

    monkeypatch.setenv(kernel_env.ENV, "torch")
    tensor_path = run()
    monkeypatch.setenv(kernel_env.ENV, "numba")
    fused = run()
    assert all(
        all(torch.equal(a, b) for a, b in zip(s, t, strict=True)) for s, t in zip(tensor_path, fused, strict=True)
    )


@pytest.mark.parametrize(("path", "rounds"), [("numba", 2), ("torch", 2), ("torch", 0)])
def test_scalar_zero_writes_store_what_the_generic_plan_stores(monkeypatch, path, rounds):
    """``WriteBatch.write`` of a Python zero (``0.0``, ``0``, ``-0.0``; planned directly) stores bit for bit what
    the same write of a zero *tensor* (the generic exponent-search plan) stores: codes, bases, decoded values (as
    float32 bits) and rebase counts, after every step, at whole-head slices, one head's boolean mask and a
    ``[B, H, T]`` mask, with bases unset, set and raised earlier in the same batch; on the fused CPU plan, the
    tensor path and (``SETTLE_ROUNDS = 0``) the tensor path's replan of every write in the batch. The zero writes
    never reach the generic planners."""
    monkeypatch.setenv(kernel_env.ENV, path)

    def run(zero: bool) -> list[tuple[torch.Tensor, ...]]:
        gen = torch.Generator().manual_seed(41)
        bufs = [LogBuffer(torch.zeros(2, 3, 0, 4)), LogBuffer(torch.zeros(2, 3, 0))]
        x = logcode.dec(torch.randint(-60, 60, (2, 3, 6, 4), generator=gen, dtype=torch.int32)).to(torch.float64)
        x[0, 1] = 0.0  # a head that has only seen zeros keeps no base
        bufs[0].append(x)
        bufs[1].append(x.sum(-1))
        mask = torch.rand(2, 3, 6, generator=gen) < 0.5
        places: list[TokenIndex] = [
            (slice(None), slice(None), slice(1, 3)),
            (1, 2, torch.arange(6) % 2 == 0),
            (mask,),
            (0, 1, slice(0, 6)),
        ]
        monkeypatch.setattr(logcode, "SETTLE_ROUNDS", rounds)
        states = []
        for step, where in enumerate(places):
            for buf in bufs:
                writes = WriteBatch()
                if step % 2:  # a rising write to the same buffer first: the zero is planned against its bases
                    rise = buf.codes.view()[0, 0, 4:6]
                    writes.write(buf, (0, 0, slice(4, 6)), torch.full(rise.shape, 1e9, dtype=torch.float64))
                if zero:
                    with monkeypatch.context() as m:  # planned directly: no exponent search, no generic plan
                        m.setattr(LogBuffer, "_plan", _refuse)
                        m.setattr(LogBuffer, "_plan_fused", _refuse)
                        writes.write(buf, where, (0.0, 0, -0.0)[step % 3])
                else:
                    writes.write(buf, where, torch.zeros(buf.codes.view()[where].shape))
                writes.commit()
                states.append(
                    (buf.codes.view().clone(), buf.base.clone(), buf.view().view(torch.int32).clone())
                    + (torch.tensor(buf.rebases),)
                )
        assert bufs[0].rebases and (bufs[0].base[0, 1] == logcode.UNSET)
        return states

    direct, generic = run(True), run(False)
    assert all(all(torch.equal(a, b) for a, b in zip(s, t, strict=True)) for s, t in zip(direct, generic, strict=True))


def _refuse(*args: object) -> None:
    raise AssertionError("a scalar zero went through the generic plan")


def test_a_scalar_zero_write_after_an_append_is_refused():
    """The direct zero plan keeps the batch's rule: no write to a buffer after an append to it, before a commit."""
    buf = LogBuffer(torch.zeros(2, 3, 0))
    writes = WriteBatch()
    writes.append_zeros(buf, (2, 3, 2))
    with pytest.raises(ValueError, match="write after an append"):
        writes.write(buf, (slice(None),) * 3, 0.0)
