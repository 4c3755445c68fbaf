"""Packed codes and witness codes stored in caller-provided byte pages (``kvcert.cache.paged``): the measured cell
layout, a ``LogBuffer`` whose codes live in the cells and a ``LayerStore`` whose chunks are views of the pages and
whose witness codes live in their cells, each compared per element with the same buffer / store on its own tensors
(writes, rebases, repairs, budget releases)."""

import pytest
import torch

from kvcert.cache.buffer import LogBuffer, WriteBatch
from kvcert.cache.paged import CellLayout, CellTokens, PagedCodes
from kvcert.cache.store import STORED_WITNESSES, LayerStore
from kvcert.quant import bytes_per_token_head, kernel_env, logcode, resolve

H, D, PAGE = 3, 64, 32


def _codecs(keys="dither-int8", values="int4"):
    return resolve(keys, "key"), resolve(values, "value")


@pytest.mark.parametrize(("keys", "values"), [("dither-int8", "int4"), ("int2", "fp8-e4m3"), ("none", "int8")])
def test_cell_holds_exactly_the_measured_packed_bytes(keys, values):
    kc, vc = _codecs(keys, values)
    lay = CellLayout.measure(kc, vc, D, D, align=4)
    measured = bytes_per_token_head(kc, D) + bytes_per_token_head(vc, D)
    assert lay.packed_bytes == measured == sum(f.nbytes for f in lay.fields)
    assert lay.nbytes % 4 == 0 and lay.packed_bytes <= lay.nbytes < lay.packed_bytes + 4
    for f in lay.fields:  # every field starts at a multiple of its own element size and fields do not overlap
        assert f.offset % f.dtype.itemsize == 0
    spans = sorted((f.offset, f.offset + f.nbytes) for f in lay.fields)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_block_codecs_are_refused():
    kc, vc = _codecs("kivi-4", "int4")
    with pytest.raises(ValueError, match="per-token codecs"):
        CellLayout.measure(kc, vc, D, D)
    lay = CellLayout.measure(*_codecs(), D, D)
    with pytest.raises(ValueError, match="page must be uint8"):
        lay.views(torch.zeros(H, PAGE, lay.nbytes + 1, dtype=torch.uint8), "k", 0, 1)


def _store(**kw):
    kc, vc = _codecs()
    return LayerStore(2, kc, vc, bands=8, pairing="rotate_half", seed=11, write_block=16, **kw)


def _fill(store, writes, scales=None):
    """Append ``writes[i]`` tokens per write, K scaled by ``scales[i]`` (1 by default)."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.tensor([7])
    for i, t in enumerate(writes):
        k = torch.randn(1, H, t, D, generator=gen) * (1.0 if scales is None else scales[i])
        v = torch.randn(1, H, t, D, generator=gen)
        store.append(k, v, rows, torch.zeros(1, dtype=torch.bool))


def test_cell_holds_the_witness_codes_the_store_writes():
    """The store's cell = the codecs' packed bytes + the witness codes a store of its configuration keeps per
    (token, KV head), both measured: the witness bytes equal the codes a store on its own tensors holds per token
    and head (8 band codes + 4 norm codes), laid out after the K/V fields without overlap."""
    kc, vc = _codecs()
    lay = _store().cell_layout(D, D, align=4)
    plain = _store()
    _fill(plain, [40, 1])
    per_token = sum(getattr(plain, name).codes.nbytes for name in STORED_WITNESSES) // (plain.n * H)
    assert lay.witness_bytes == per_token == 8 + 4
    assert lay.packed_bytes == bytes_per_token_head(kc, D) + bytes_per_token_head(vc, D)
    assert lay.nbytes == -(-(lay.packed_bytes + lay.witness_bytes) // 4) * 4
    assert {f.name for f in lay.fields if f.tensor == "w"} == set(STORED_WITNESSES)
    spans = sorted((f.offset, f.offset + f.nbytes) for f in lay.fields)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)) and spans[-1][1] <= lay.nbytes
    with pytest.raises(ValueError, match="log8"):
        _store(witness="f32").cell_layout(D, D)
    with pytest.raises(ValueError, match="one token of one head"):
        CellLayout.measure(kc, vc, D, D, witnesses={"k_band": torch.zeros(1, 2, 1, 8, dtype=torch.uint8)})


@pytest.mark.parametrize("path", ["numba", "torch"])
def test_log_buffer_in_cells_stores_what_its_own_tensor_stores(monkeypatch, path):
    """A ``LogBuffer`` whose codes are ``CellTokens`` stores, after every write, the codes, bases, decoded values
    (bit for bit) and rebase counts of one on its own tensor, through appends, whole-run writes, masked writes and
    writes that raise bases (every stored code re-coded in place); the cells hold exactly those codes and no byte
    outside the buffer's field of the sequence's pages changes."""
    monkeypatch.setenv(kernel_env.ENV, path)
    wit = {"a": torch.zeros(1, 1, 1, 4, dtype=torch.uint8), "b": torch.zeros(1, 1, 1, dtype=torch.uint8)}
    lay = CellLayout.measure(*_codecs(), D, D, align=4, witnesses=wit)
    pool = torch.randint(0, 256, (5, H, 8, lay.nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    table = [3, 0, 4]
    pages = PagedCodes(lay, 8, lambda i: pool[table[i]])
    field = lay.field("w", "a")
    outside = torch.ones(lay.nbytes, dtype=torch.bool)
    outside[field.offset : field.offset + field.nbytes] = False
    before = pool.clone()
    cells = LogBuffer(
        torch.zeros(1, H, 0, 4), codes=CellTokens(lambda: pages, "a", torch.zeros(1, H, 0, 4, dtype=torch.uint8))
    )
    own = LogBuffer(torch.zeros(1, H, 0, 4))
    gen = torch.Generator().manual_seed(3)
    x = logcode.dec(torch.randint(-60, 60, (1, H, 11, 4), generator=gen, dtype=torch.int32)).to(torch.float64)
    x[0, 1] = 0.0  # a head that has only seen zeros keeps no base
    mask = torch.rand(1, H, 11, generator=gen) < 0.5
    steps = [
        ("append", None, x),
        ("write", (slice(None), slice(None), slice(2, 9)), torch.rand(1, H, 7, 4, generator=gen, dtype=torch.float64)),
        ("write", (0, 2, torch.arange(11) % 3 == 0), 0.0),
        ("write", (mask,), torch.tensor(5.0, dtype=torch.float64)),
        ("write", (0, 0, slice(4, 6)), torch.full((2, 4), 1e9, dtype=torch.float64)),  # raises head 0's base
        ("append", None, torch.full((1, H, 9, 4), 1e12, dtype=torch.float64)),  # raises every set base, one page on
        ("write", (slice(None), slice(None), slice(0, 20, 2)), 0.0),  # a strided run: every cell rewritten
    ]
    for kind, where, val in steps:
        for buf in (cells, own):
            writes = WriteBatch()
            if kind == "append":
                writes.append(buf, val)
            else:
                writes.write(buf, where, val)
            writes.commit()
        assert torch.equal(cells.codes.view(), own.codes.view()) and torch.equal(cells.base, own.base)
        assert torch.equal(cells.view().view(torch.int32), own.view().view(torch.int32))
        assert cells.rebases == own.rebases and cells.nbytes == own.nbytes
        for j, block in enumerate(table):
            lo, hi = j * 8, min((j + 1) * 8, own.n)
            if hi > lo:
                cell = pool[block, :, : hi - lo, field.offset : field.offset + field.nbytes]
                assert torch.equal(cell, own.codes.view()[0, :, lo:hi])
        assert torch.equal(pool[..., outside], before[..., outside])
    assert own.rebases > 0 and own.n == 20
    assert torch.equal(pool[[1, 2]], before[[1, 2]])  # blocks outside the table are untouched
    with pytest.raises(ValueError, match="cannot drop"):
        cells.drop_before(1)
    with pytest.raises(ValueError, match="cannot gather"):
        cells.gather(torch.zeros(1, H, 1, dtype=torch.int64))


def _paged(store, layout, pool, table):
    store.pages = PagedCodes(layout, PAGE, lambda i: pool[table[i]])
    return store


def _same_witnesses(paged, plain):
    """The stores' witnesses, per element: stored codes, bases, decoded values (bit for bit) and rebase counts."""
    for name in STORED_WITNESSES:
        a, b = getattr(paged, name), getattr(plain, name)
        assert torch.equal(a.codes.view(), b.codes.view()) and torch.equal(a.base, b.base), name
        assert torch.equal(a.view().view(torch.int32), b.view().view(torch.int32)) and a.rebases == b.rebases, name
    assert torch.equal(paged.k_wit.view(), plain.k_wit.view())
    assert paged.bytes_witness() == plain.bytes_witness() and paged.bytes_device() == plain.bytes_device()


def _cells_hold_the_codes(store, layout, pool, table):
    """Every live token's witness codes are in its cell of the pool, per element."""
    for name in STORED_WITNESSES:
        f = layout.field("w", name)
        codes = getattr(store, name).codes.view()[0]  # [H, n, *tail]
        for j in range(-(-store.n // PAGE)):
            lo, hi = j * PAGE, min((j + 1) * PAGE, store.n)
            cell = pool[table[j], :, : hi - lo, f.offset : f.offset + f.nbytes]
            assert torch.equal(cell, codes[:, lo:hi].reshape(cell.shape)), (name, j)


def test_paged_store_witnesses_follow_rebases_repairs_and_releases():
    """A paged store and the same store on its own tensors, through writes whose key norms raise the bases (every
    stored code re-coded in the cells in place), persistent repairs (boolean-mask witness writes) and device-budget
    releases: the same witnesses per element after every step, and the cells hold the codes."""
    lay = _store().cell_layout(D, D, align=4)
    pool = torch.zeros(6, H, PAGE, lay.nbytes, dtype=torch.uint8)
    table = [4, 1, 3]
    paged, plain = _paged(_store(device_budget=0.72), lay, pool, table), _store(device_budget=0.72)
    for writes, scales in (([20, 1, 1], [1e-3, 1e-3, 1e-3]), ([16, 1], [1.0, 1e3]), ([20, 1], [1e6, 1.0])):
        for st in (paged, plain):
            _fill(st, writes, scales)
        _same_witnesses(paged, plain)
        _cells_hold_the_codes(paged, lay, pool, table)
    assert paged.k_hat_norm.rebases > 0 and paged.k_band.rebases > 0
    mask = torch.zeros(paged.n, dtype=torch.bool)
    mask[[2, 5, 17, 40]] = True
    for st in (paged, plain):
        assert st.persist_heads([(0, 1), (0, 2)], [mask, slice(30, 50)]) == [True, True]
    _same_witnesses(paged, plain)
    _cells_hold_the_codes(paged, lay, pool, table)
    for st in (paged, plain):
        _fill(st, [30], [1.0])  # 30 pending exact tokens raise the floor: held repairs go back to their codes
    assert paged.released == plain.released > 0 and paged.n_held == 0
    _same_witnesses(paged, plain)
    _cells_hold_the_codes(paged, lay, pool, table)
    assert int(pool[[0, 2, 5]].sum()) == 0


def test_paged_witnesses_fail_closed():
    """A store refuses pages that cannot hold its witnesses (f32 witnesses, a layout without the witness fields or
    measured for other bands), pages set after its first write or removed later, and a write refused by a codec
    check leaves every byte of the pages as it was."""
    lay = _store().cell_layout(D, D, align=4)
    pool = torch.zeros(3, H, PAGE, lay.nbytes, dtype=torch.uint8)
    one = ([1], None)
    with pytest.raises(ValueError, match="log8"):
        _fill(_paged(_store(witness="f32"), lay, pool, [0]), *one)
    bare = CellLayout.measure(*_codecs(), D, D, align=4)
    with pytest.raises(ValueError, match="no field w:k_band"):
        _fill(_paged(_store(), bare, torch.zeros(1, H, PAGE, bare.nbytes, dtype=torch.uint8), [0]), *one)
    kc, vc = _codecs()
    four = LayerStore(2, kc, vc, bands=4, pairing="rotate_half", seed=11, write_block=16)
    with pytest.raises(ValueError, match="another witness configuration"):
        _fill(_paged(four, lay, pool, [0]), *one)
    late = _store()
    _fill(late, *one)
    with pytest.raises(ValueError, match="before its first write"):
        _fill(_paged(late, lay, pool, [0]), *one)
    assert int(pool.sum()) == 0  # nothing refused wrote a byte
    gone = _paged(_store(), lay, pool, [0])
    _fill(gone, *one)
    gone.pages = None
    with pytest.raises(ValueError, match="before its first write"):
        _fill(gone, *one)
    with pytest.raises(ValueError, match="pages were removed"):
        gone.k_hat_norm.codes.view()
    fp16 = LayerStore(2, resolve("none", "key"), vc, bands=8, pairing="rotate_half", seed=11)
    lay16 = fp16.cell_layout(D, D, align=4)
    pool16 = torch.zeros(1, H, PAGE, lay16.nbytes, dtype=torch.uint8)
    _paged(fp16, lay16, pool16, [0])
    rows, keep = torch.tensor([7]), torch.zeros(1, dtype=torch.bool)
    fp16.append(torch.randn(1, H, 5, D), torch.randn(1, H, 5, D), rows, keep)
    big = torch.randn(1, H, 1, D)
    big[0, 2, 0, 7] = 1e6  # beyond the fp16 range: the write that encodes it is refused
    fp16.append(big, torch.randn(1, H, 1, D), rows, keep)
    snapshot = pool16.clone()
    with pytest.raises(ValueError, match="fp16 range"):
        fp16.append(torch.randn(1, H, 1, D), torch.randn(1, H, 1, D), rows, keep)
    assert torch.equal(pool16, snapshot) and int(snapshot.sum()) > 0


def test_paged_store_keeps_its_codes_in_the_pages_only():
    lay = _store().cell_layout(D, D, align=4)
    pool = torch.zeros(6, H, PAGE, lay.nbytes, dtype=torch.uint8)  # a block pool; the table maps pages to blocks
    table = [4, 1, 3]
    paged, plain = _store(), _store()
    paged.pages = PagedCodes(lay, PAGE, lambda i: pool[table[i]])
    writes = [5, 40, 1, 30, 1, 1]  # chunks of 16 and 32 tokens, one crossing the page boundary at 32
    _fill(paged, writes)
    _fill(plain, writes)
    assert paged.k.n_encoded == plain.k.n_encoded == 64
    lo, hi = pool.data_ptr(), pool.data_ptr() + pool.numel()
    for ts, ref, name in ((paged.k, plain.k, "k"), (paged.v, plain.v, "v")):
        assert ts.packed_nbytes() == ref.packed_nbytes() > 0
        for c in ts.chunks:
            assert c.stop - c.start <= PAGE and c.start // PAGE == (c.stop - 1) // PAGE  # one page per chunk
            for t in c.packed.tensors.values():
                assert lo <= t.data_ptr() < hi  # a view of the pool: no second copy of the codes
            # the codes read back from the page decode to the served (decoded at write time) entries, per element
            dec = ts.codec.decode(c.packed, key=c.key).to(torch.float32)
            assert torch.equal(dec, ts.served.view()[:, :, c.start : c.stop])
            page = pool[table[c.start // PAGE]]
            views = lay.views(page, name, c.start % PAGE, c.start % PAGE + c.stop - c.start)
            assert all(v.data_ptr() == c.packed.tensors[n].data_ptr() for n, v in views.items())
        assert torch.equal(ts.served.view(), ref.served.view())  # same codes as the store on its own tensors
    _same_witnesses(paged, plain)
    _cells_hold_the_codes(paged, lay, pool, table)
    assert int(pool[[0, 2, 5]].abs().sum()) == 0  # blocks outside the table are untouched


def test_paged_store_refuses_moves_and_batches():
    lay = _store().cell_layout(D, D, align=4)
    pool = torch.zeros(2, H, PAGE, lay.nbytes, dtype=torch.uint8)
    store = _store()
    store.pages = PagedCodes(lay, PAGE, lambda i: pool[i])
    _fill(store, [20, 1])
    with pytest.raises(ValueError, match="pages"):
        store.drop_before(1)
    with pytest.raises(ValueError, match="pages"):
        store.gather(torch.arange(store.n).view(1, 1, -1).expand(1, H, -1).contiguous())
    with pytest.raises(ValueError, match="B = 2"):
        store.append(
            torch.zeros(2, H, 1, D), torch.zeros(2, H, 1, D), torch.tensor([1, 2]), torch.zeros(2, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match="page_tokens"):
        PagedCodes(lay, 0, lambda i: pool[i])
