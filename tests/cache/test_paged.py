"""Packed codes stored in caller-provided byte pages (``kvcert.cache.paged``): the measured cell layout and a
``LayerStore`` whose chunks are views of the pages, compared per element with the same store on its own tensors."""

import pytest
import torch

from kvcert.cache.paged import CellLayout, PagedCodes
from kvcert.cache.store import LayerStore
from kvcert.quant import bytes_per_token_head, resolve

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


def _store():
    kc, vc = _codecs()
    return LayerStore(2, kc, vc, bands=8, pairing="rotate_half", seed=11, write_block=16)


def _fill(store, writes):
    gen = torch.Generator().manual_seed(5)
    rows = torch.tensor([7])
    for t in writes:
        k = torch.randn(1, H, t, D, generator=gen)
        v = torch.randn(1, H, t, D, generator=gen)
        store.append(k, v, rows, torch.zeros(1, dtype=torch.bool))


def test_paged_store_keeps_its_codes_in_the_pages_only():
    lay = CellLayout.measure(*_codecs(), D, D, align=4)
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
    for name in ("k_band", "k_wit", "k_hat_norm", "v_res", "v_hat_norm", "v_dist"):
        assert torch.equal(getattr(paged, name).view(), getattr(plain, name).view())
    assert int(pool[[0, 2, 5]].abs().sum()) == 0  # blocks outside the table are untouched


def test_paged_store_refuses_moves_and_batches():
    lay = CellLayout.measure(*_codecs(), D, D, align=4)
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
