"""Packed codes and witness codes stored in caller-provided byte pages (``kvcert.cache.paged``): the measured cell
layout, a ``LogBuffer`` whose codes live in the cells and a ``LayerStore`` whose chunks are views of the pages and
whose witness codes live in their cells, each compared per element with the same buffer / store on its own tensors
(writes, rebases, repairs, budget releases)."""

import pytest
import torch

from kvcert.attention.certified import ReadConfig, certified_read
from kvcert.cache.buffer import GrowBuffer, LogBuffer, WriteBatch
from kvcert.cache.gate import Gate
from kvcert.cache.host_pages import HostBlocks, HostPages, HostTokens
from kvcert.cache.paged import BlockPool, CellLayout, CellTokens, PagedCodes
from kvcert.cache.store import SERVED_NORMS, STORED_WITNESSES, LayerStore
from kvcert.quant import bytes_per_token_head, kernel_env, logcode, resolve
from kvcert.quant.dither import DitherCodec
from kvcert.quant.per_head import PerHeadCodec

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
    with pytest.raises(ValueError, match="each head in its own codec; a serving engine's pages hold one cell layout"):
        CellLayout.measure(DitherCodec(head_bits=(8, 4)), vc, D, D)
    with pytest.raises(ValueError, match="'mixed\\[int8,int4\\]' stores each head in its own codec"):
        CellLayout.measure(vc, PerHeadCodec(("int8", "int4")), D, D)
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
    and head (8 band codes + 1 value-residual code; the served norms are derived), laid out after the K/V fields
    without overlap."""
    kc, vc = _codecs()
    lay = _store().cell_layout(D, D, align=4)
    plain = _store()
    _fill(plain, [40, 1])
    per_token = sum(getattr(plain, name).codes.nbytes for name in STORED_WITNESSES) // (plain.n * H)
    assert lay.witness_bytes == per_token == 8 + 1
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
    """The stores' witnesses, per element: stored codes, bases, decoded values (bit for bit) and rebase counts; the
    derived ones (``k_wit``, the served norms) bit for bit."""
    for name in STORED_WITNESSES:
        a, b = getattr(paged, name), getattr(plain, name)
        assert torch.equal(a.codes.view(), b.codes.view()) and torch.equal(a.base, b.base), name
        assert torch.equal(a.view().view(torch.int32), b.view().view(torch.int32)) and a.rebases == b.rebases, name
    for name in ("k_wit", *SERVED_NORMS):
        assert torch.equal(getattr(paged, name).view().view(torch.int32), getattr(plain, name).view().view(torch.int32))
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
    paged, plain = _paged(_store(device_budget=0.71), lay, pool, table), _store(device_budget=0.71)
    for writes, scales in (([20, 1, 1], [1e-3, 1e-3, 1e-3]), ([16, 1], [1.0, 1e3]), ([20, 1], [1e6, 1.0])):
        for st in (paged, plain):
            _fill(st, writes, scales)
        _same_witnesses(paged, plain)
        _cells_hold_the_codes(paged, lay, pool, table)
    assert paged.k_band.rebases > 0
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
        gone.v_res.codes.view()
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


def _host_paged(store, layout, pool, host, table):
    """``store`` with its codes in ``pool`` and its exact host tier in ``host``, both addressed by ``table``."""
    pages = HostPages(host, torch.tensor(table, dtype=torch.int32))  # int32: vLLM's block-table dtype
    store.pages = PagedCodes(layout, PAGE, lambda i: pool[table[i]], pages)
    return store


def _same_store(paged, plain):
    """Host tier, served entries, exact / held flags and witnesses of the stores, per element."""
    assert isinstance(paged.k.host, HostTokens) and isinstance(plain.k.host, GrowBuffer)
    for a, b in ((paged.k, plain.k), (paged.v, plain.v)):
        assert a.host.shape == b.host.shape and a.host.dtype == b.host.dtype and a.host.device == b.host.device
        assert torch.equal(a.host.view(), b.host.view()) and a.host.nbytes == b.host.nbytes
        for name in ("served", "exact", "held"):
            assert torch.equal(getattr(a, name).view(), getattr(b, name).view()), name
    assert paged.bytes_host() == plain.bytes_host() and paged.n_held == plain.n_held
    _same_witnesses(paged, plain)


def _host_blocks_hold_the_tokens(store, host, table, ks, vs):
    """The exact K/V ``ks, vs[1, H, n, D]`` sit in ``host`` at the block-table addresses: token ``t`` at block
    ``table[t // PAGE]``, offset ``t % PAGE`` (read from the pool tensors, not through the store)."""
    n = ks.shape[2]
    assert store.n == n
    for t in range(n):
        block, off = table[t // PAGE], t % PAGE
        assert torch.equal(host.k[block, :, off], ks[0, :, t]) and torch.equal(host.v[block, :, off], vs[0, :, t]), t


def _exact(q):
    """Exact attention of ``q[1, Hq, 1, D]`` over host-tier K/V (GQA), the repair the read path calls."""

    def fn(keys, values, mask, heads=None):
        h0, h1 = heads if heads is not None else (0, keys.shape[1])
        g = q.shape[1] // keys.shape[1]
        k, v = (x[:, h0:h1].repeat_interleave(g, dim=1) for x in (keys, values))
        out = torch.nn.functional.scaled_dot_product_attention(q[:, h0 * g : h1 * g], k, v, attn_mask=mask)
        return out.transpose(1, 2)

    return fn


def test_paged_store_keeps_its_host_tier_in_the_host_blocks():
    """A paged store whose pages carry host blocks, the same paged store with its host tier in tensors of its own,
    and the same store unpaged, through writes that cross page boundaries, persistent repairs, a read that repairs
    heads from the host tier and device-budget releases: the same host view, served entries, flags and witnesses
    per element after every step, the same read result, and the exact K/V of every token in the host pool at its
    block-table address; blocks outside the table stay untouched. (After the release only the two paged stores are
    compared: a paged store splits a write block that crosses a page into one chunk per page, and the budget
    releases held entries a chunk at a time, so an unpaged store may release more.)"""
    lay = _store().cell_layout(D, D, align=4)
    pool, own_pool = (torch.zeros(6, H, PAGE, lay.nbytes, dtype=torch.uint8) for _ in range(2))
    host = HostBlocks(torch.full((6, H, PAGE, D), -7.0), torch.full((6, H, PAGE, D), -7.0))
    table = [4, 1, 3]
    paged = _host_paged(_store(device_budget=0.71), lay, pool, host, table)
    own, plain = _paged(_store(device_budget=0.71), lay, own_pool, table), _store(device_budget=0.71)
    stores = (paged, own, plain)
    gen = torch.Generator().manual_seed(21)
    rows, keep = torch.tensor([7]), torch.zeros(1, dtype=torch.bool)
    ks, vs = torch.zeros(1, H, 0, D), torch.zeros(1, H, 0, D)
    for t in (20, 1, 1, 30, 1, 17, 1, 20):  # 91 tokens, three pages; the write block [16, 48) crosses a page
        k, v = torch.randn(1, H, t, D, generator=gen), torch.randn(1, H, t, D, generator=gen)
        ks, vs = torch.cat([ks, k], 2), torch.cat([vs, v], 2)
        for st in stores:
            st.append(k, v, rows, keep)
        for ref in stores[1:]:
            _same_store(paged, ref)
        _host_blocks_hold_the_tokens(paged, host, table, ks, vs)
        if t == 1 and paged.n == 71:  # before the last write: repairs, then a read over them
            mask = torch.zeros(paged.n, dtype=torch.bool)
            mask[[2, 5, 33, 40]] = True
            for st in stores:
                assert st.persist_heads([(0, 1), (0, 2)], [mask, slice(30, 50)]) == [True, True]
            for ref in stores[1:]:
                _same_store(paged, ref)
            q = torch.randn(1, 2 * H, 1, D, generator=gen) * 3.0
            see = torch.ones(1, 1, 1, paged.n, dtype=torch.bool)
            cfg = ReadConfig(Gate.certified(0.05), True, 1e-6)
            got, *refs = (certified_read(q, st, see, D**-0.5, cfg, _exact(q)) for st in stores)
            assert bool(got.repaired.any())  # heads repaired from the host tier (its blocks for the paged store)
            for want in refs:
                for name in ("out", "cert_pre", "cert", "repaired", "true_tv", "true_out_err", "out_bound"):
                    assert torch.equal(getattr(got, name), getattr(want, name)), name
                assert got.bytes_paged == want.bytes_paged > 0
            stores = stores[:2]  # the last write releases held entries (see the docstring)
    # the 20 pending exact tokens of the last write raised the floor: held repairs went back to their codes (some)
    assert paged.released == own.released > 0
    assert bool((host.k[[0, 2, 5]] == -7.0).all()) and bool((host.v[[0, 2, 5]] == -7.0).all())
    assert bool((host.k[3, :, paged.n - 2 * PAGE :] == -7.0).all())  # past the last token: untouched


def test_host_blocks_fail_closed():
    """Host blocks that do not match the engine's blocks (count, heads, block size), the store's K/V (heads, head
    dim, dtype) or each other are refused with ``ValueError``; host blocks added or removed after a store's first
    write are refused; a table row too short for the tokens is refused; a host tier in blocks refuses to move
    tokens and numpy appends."""
    lay = _store().cell_layout(D, D, align=4)
    pool = torch.zeros(3, H, PAGE, lay.nbytes, dtype=torch.uint8)
    table = torch.zeros(1, 2, dtype=torch.int32)
    for shape in ((4, H, PAGE, D), (3, H + 1, PAGE, D), (3, H, PAGE // 2, D)):
        with pytest.raises(ValueError, match="do not match the engine's blocks"):
            BlockPool(lay, pool, table, HostBlocks(torch.zeros(shape), torch.zeros(shape)))
    with pytest.raises(ValueError, match="same blocks, heads and block size"):
        HostBlocks(torch.zeros(3, H, PAGE, D), torch.zeros(3, H, PAGE + 1, D))
    with pytest.raises(ValueError, match="one floating dtype"):
        HostBlocks(torch.zeros(3, H, PAGE, D), torch.zeros(3, H, PAGE, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="tokens each"):
        PagedCodes(
            lay, PAGE, lambda i: pool[i], HostPages(HostBlocks.empty(3, H, PAGE // 2, D, D, torch.float32), table[0])
        )
    for k, v in (
        (torch.zeros(3, H, PAGE, D // 2), torch.zeros(3, H, PAGE, D)),  # another head dim
        (torch.zeros(3, H, PAGE, D, dtype=torch.float64), torch.zeros(3, H, PAGE, D, dtype=torch.float64)),
    ):
        store = _host_paged(_store(), lay, pool, HostBlocks(k, v), [0, 1])
        with pytest.raises(ValueError, match="but the store writes"):
            _fill(store, [1])
    assert int(pool.sum()) == 0  # a refused store wrote nothing into the cells
    host = HostBlocks.empty(3, H, PAGE, D, D, torch.float32)
    late = _paged(_store(), lay, pool, [0])
    _fill(late, [1])
    late.pages = PagedCodes(lay, PAGE, lambda i: pool[i], HostPages(host, table[0]))
    with pytest.raises(ValueError, match="host blocks must be given with its pages"):
        _fill(late, [1])
    gone = _host_paged(_store(), lay, pool, host, [0, 1])
    _fill(gone, [1])
    gone.pages = PagedCodes(lay, PAGE, lambda i: pool[i])
    with pytest.raises(ValueError, match="host blocks must be given with its pages"):
        _fill(gone, [1])
    with pytest.raises(ValueError, match="host blocks, but they were removed"):
        gone.k.host.view()
    short = _host_paged(_store(), lay, pool, host, [2])
    with pytest.raises(ValueError, match="has 1 pages, the tokens need 2"):
        _fill(short, [PAGE + 1])
    tokens = _host_paged(_store(), lay, pool, host, [0, 1])
    _fill(tokens, [3])
    buf = tokens.k.host
    assert not buf.numpy_ok
    with pytest.raises(ValueError, match="numpy"):
        buf.append_array(buf.view().numpy())
    with pytest.raises(ValueError, match="expected"):
        buf.append(torch.zeros(1, H, 1, D + 1))
    with pytest.raises(ValueError, match="cannot drop"):
        buf.drop_before(1)
    with pytest.raises(ValueError, match="cannot gather"):
        buf.gather(torch.zeros(1, H, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="B = 2"):
        HostTokens(lambda: HostPages(host, table[0]), "k", torch.zeros(2, H, 0, D))
