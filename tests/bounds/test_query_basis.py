"""The query-aware basis of the omitted keys' sketch (``docs/math.md#query-aware-basis``): what it is (eigenvectors
of ``K/tr K + Q/tr Q``), its fallbacks, bad input, and the point of it — for queries like the ones it was built from,
the per-token bound is tighter than with the keys' principal basis; soundness for any query is the basis sketch's
(tested for this basis in ``test_page_spectra.py`` and ``test_pages.py``'s page fuzz)."""

from __future__ import annotations

import math

import pytest
import torch

from kvcert.bounds import pages as pg

F64 = torch.float64


def _head_projector(vecs: torch.Tensor, r: int) -> torch.Tensor:
    a = vecs[..., :r]
    return a @ a.transpose(-1, -2)


def test_query_aware_basis_is_the_eigenbasis_of_the_trace_normalised_sum():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 50, 16, generator=gen, dtype=F64) * torch.linspace(0.2, 4.0, 16, dtype=F64)
    q = torch.randn(3, 20, 16, generator=gen, dtype=F64) * torch.linspace(3.0, 0.1, 16, dtype=F64)
    gram = q.transpose(-1, -2) @ q
    vecs = pg.query_aware_basis(keys, gram)
    gk = keys.transpose(-1, -2) @ keys
    mixed = gk / gk.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
    mixed = mixed + gram / gram.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
    assert torch.allclose(vecs.transpose(-1, -2) @ vecs, torch.eye(16, dtype=F64).expand(3, 16, 16), atol=1e-12)
    rayleigh = (vecs.transpose(-1, -2) @ mixed @ vecs).diagonal(dim1=-2, dim2=-1)
    assert torch.allclose(rayleigh, torch.linalg.eigvalsh(mixed).flip(-1), atol=1e-12)  # largest first
    assert bool((rayleigh[..., :-1] >= rayleigh[..., 1:] - 1e-12).all())


@pytest.mark.parametrize("gram", ["zero", "nan", "inf"])
def test_without_a_usable_query_gram_it_is_the_principal_basis(gram):
    """A zero Gram (no query read yet) or a non-finite one (fail closed) leaves the keys' principal basis: the same
    head subspace (the spectrum is well separated, so the subspace is determined)."""
    keys = torch.randn(2, 40, 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    keys = keys * torch.tensor([9.0, 7.0, 5.0, 3.0, 1.0, 0.5, 0.2, 0.1], dtype=F64)
    g = torch.zeros(2, 8, 8, dtype=F64)
    if gram != "zero":
        g[1, 2, 3] = float(gram)
        g[0] = torch.eye(8, dtype=F64) * (float("inf") if gram == "inf" else float("nan"))
    got, ref = pg.query_aware_basis(keys, g), pg.principal_basis(keys)
    assert torch.allclose(_head_projector(got, 3), _head_projector(ref, 3), atol=1e-9)


def test_without_key_energy_it_follows_the_queries():
    """All-zero keys: the head is the queries' principal subspace (queries in channels 2 and 3 only)."""
    q = torch.randn(1, 30, 8, generator=torch.Generator().manual_seed(2), dtype=F64)
    q = q * torch.tensor([0.0, 0.0, 8.0, 6.0, 0.0, 0.0, 0.0, 0.0], dtype=F64)
    vecs = pg.query_aware_basis(torch.zeros(1, 5, 8, dtype=F64), q.transpose(-1, -2) @ q)
    proj = _head_projector(vecs, 2)
    assert torch.allclose(proj[0, 2:4, 2:4], torch.eye(2, dtype=F64), atol=1e-12)


def test_the_head_captures_the_queries_where_the_keys_principal_basis_leaves_them_out():
    """Keys whose energy sits in channels 0–7 and queries in channels 8–11 (where the keys are small): with rank 8 the
    principal basis leaves every query outside its head (``‖q⊥‖ = ‖q‖``), the query-aware basis takes most of it in;
    so the tail's coding error, which the bound multiplies by ``‖q⊥‖``, meets a smaller query: the per-token bound
    over those queries is lower at the median, and above the exact logit everywhere."""
    gen = torch.Generator().manual_seed(3)
    scale = torch.cat([torch.full((8,), 6.0), torch.full((8,), 1.0)]).to(F64)
    keys = (torch.randn(1, 400, 16, generator=gen, dtype=F64) * scale).float()
    qscale = torch.cat([torch.full((8,), 0.05), torch.full((4,), 4.0), torch.full((4,), 0.05)]).to(F64)
    calib = torch.randn(1, 64, 16, generator=gen, dtype=F64) * qscale
    q = (torch.randn(1, 32, 16, generator=gen, dtype=F64) * qscale).float()
    plain = pg.basis_sketch(keys, 8)
    aware = pg.basis_sketch(keys, 8, query_gram=calib.transpose(-1, -2) @ calib)
    for sk, most in ((plain, 0.0), (aware, 0.5)):
        a = sk.basis.to(F64)
        q64 = q.to(F64)
        inside = (q64 @ a).norm(dim=-1) / q64.norm(dim=-1)
        assert float(inside.median()) >= most
    assert float(((q.to(F64) @ plain.basis.to(F64)).norm(dim=-1) / q.to(F64).norm(dim=-1)).max()) < 0.3
    sc = 1 / math.sqrt(16)
    exact = sc * q.to(F64) @ keys.to(F64).transpose(-1, -2)
    u_plain = pg.basis_logit_bound(q, plain, sc, 0.0)
    u_aware = pg.basis_logit_bound(q, aware, sc, 0.0)
    assert bool((u_plain >= exact).all()) and bool((u_aware >= exact).all())
    assert float((u_aware - exact).median()) < 0.5 * float((u_plain - exact).median())


def test_query_aware_basis_refuses_a_gram_of_the_wrong_shape():
    keys = torch.randn(2, 10, 8)
    with pytest.raises(ValueError, match="query_gram must be"):
        pg.query_aware_basis(keys, torch.zeros(2, 8, 7))
    with pytest.raises(ValueError, match="query_gram must be"):
        pg.basis_sketch(keys, 4, query_gram=torch.zeros(3, 8, 8))
