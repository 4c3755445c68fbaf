"""The one read path: each variant serves what its read function serves, records it once, and notifies observers."""

from __future__ import annotations

import pytest
import torch
from attention_cases import D
from attention_cases import exact_fallback as _exact
from attention_cases import setup_read as _setup

from kvcert.attention.certified import ReadConfig, certified_read
from kvcert.attention.ladder import LadderConfig, ladder_read
from kvcert.attention.read_path import (
    CertifiedReadPath,
    LadderReadPath,
    Recorder,
    ResidentReadPath,
    measured_tv_slack,
    slot_mask,
    step_record,
)
from kvcert.cache.events import ReadEvent
from kvcert.cache.gate import Gate


class _Events:
    def __init__(self) -> None:
        self.reads: list[ReadEvent] = []

    def on_write(self, event: object) -> None:
        raise AssertionError("a read path writes nothing")

    def on_read(self, event: ReadEvent) -> None:
        self.reads.append(event)


def test_certified_path_serves_certified_read_and_records_every_cell_once() -> None:
    st, q, mask = _setup("int4", 96, 0, 3.0, nq=2)
    cfg = ReadConfig(Gate.certified(0.05), True, 1e-6)
    exact = _exact(st, q, mask, D**-0.5)
    want = certified_read(q, st, mask, D**-0.5, cfg, exact)
    events = _Events()
    sink = Recorder([events])
    rows = torch.tensor([7, 9])
    got = CertifiedReadPath(cfg, sink).read(q, st, mask, D**-0.5, exact, step=3, rows=rows)
    assert torch.equal(got.out, want.out) and torch.equal(got.result.cert, want.cert)
    assert torch.equal(got.result.out_bound, want.out_bound) and torch.equal(got.result.repaired, want.repaired)
    rec = got.record
    assert sink.records == [rec] and sink.bytes_paged == want.bytes_paged > 0 and not sink.resident_records
    assert (rec.step, rec.layer, rec.queries) == (3, st.layer, 2) and rec.chain is not None
    assert torch.equal(rec.reading("served"), want.cert.amax(-1).to(torch.float64))
    assert rec.violations == int((want.true_tv > want.cert_pre).sum()) == 0
    assert rec.out_violations == int((want.true_out_err > want.out_bound).sum()) == 0
    (ev,) = events.reads
    assert torch.equal(ev.rows, rows) and ev.step == 3 and torch.equal(ev.certificate, want.cert[..., -1])
    assert torch.equal(ev.repaired, rec.reading("repaired")) and bool(ev.repaired.any())


def test_a_nan_measurement_counts_as_a_violation_never_as_a_pass() -> None:
    st, q, mask = _setup("int4", 96, 0, 3.0, nq=2)
    cfg = ReadConfig(Gate.certified(0.05), True, 1e-6)
    res = certified_read(q, st, mask, D**-0.5, cfg, _exact(st, q, mask, D**-0.5))
    assert step_record(res, st.layer, 0, 2, None).violations == 0
    res.true_tv = res.true_tv.clone()
    res.true_tv.view(-1)[0] = float("nan")
    res.true_out_err = res.true_out_err.clone()
    res.true_out_err.view(-1)[:2] = float("nan")
    rec = step_record(res, st.layer, 0, 2, None)
    assert (rec.violations, rec.out_violations) == (1, 2)


def test_ladder_path_is_ladder_read_without_chain_readings() -> None:
    st, q, mask = _setup("int4", 96, 1, 3.0, nq=1)
    sc = D**-0.5

    def exact(hk, hv, m, heads=None):
        assert heads is None and m is mask  # the ladder asks for every head, under the read's own mask
        return _exact(st, q, mask, sc)(hk, hv, m)

    want = ladder_read(q, st, mask, sc, LadderConfig(), exact)
    path = LadderReadPath(LadderConfig(), sink=Recorder())
    got = path.read(q, st, mask, sc, exact)
    assert torch.equal(got.out, want.out) and torch.equal(got.result.out_bound, want.out_bound)
    assert got.record.chain is None and path.stats.reads == 1 and path.stats.cells == q.shape[0] * q.shape[1]


def test_resident_path_reads_layers_without_pages_through_its_fallback_and_needs_the_logical_mask() -> None:
    st, q, mask = _setup("int8", 64, 2, 1.0, nq=1)
    cfg = ReadConfig(Gate.off(), False, 1e-6)
    exact = _exact(st, q, mask, D**-0.5)
    pages: dict = {}
    path = ResidentReadPath(Gate.off(), False, pages, CertifiedReadPath(cfg))
    got = path.read(q, st, mask, D**-0.5, exact)
    assert torch.equal(got.out, certified_read(q, st, mask, D**-0.5, cfg, exact).out) and got.resident is None
    pages[st.layer] = object()  # a layer with omitted pages: the resident read, which needs positions
    with pytest.raises(ValueError, match="position-space mask"):
        path.read(q, st, mask, D**-0.5, exact)


def test_slot_mask_gathers_the_logical_mask_at_each_slot_position() -> None:
    logical = torch.tensor([[[[True, False, True, True]]]])  # [1, 1, Q=1, T=4]
    positions = torch.tensor([[[0, 2, 3], [1, 3, 2]]])  # two KV heads keep different slots
    got = slot_mask(logical, positions)
    assert got.tolist() == [[[[True, True, True]], [[False, True, True]]]]
    with pytest.raises(ValueError, match="covering every logical position"):
        slot_mask(logical[..., :3], positions)


def test_a_measured_tv_meets_its_bound_within_its_float64_rounding_only() -> None:
    """A read served exact has certificate 0 and a measured TV of a few ulps: within ``measured_tv_slack`` it is
    no violation, a TV one slack above it is one."""
    st, q, mask = _setup("int4", 96, 0, 3.0, nq=2)
    cfg = ReadConfig(Gate.certified(0.05), True, 1e-6)
    res = certified_read(q, st, mask, D**-0.5, cfg, _exact(st, q, mask, D**-0.5))
    slack = measured_tv_slack(96)
    assert slack == 194 * 2.0**-53
    res.cert_pre = torch.zeros_like(res.cert_pre)
    res.true_tv = torch.full_like(res.true_tv, 5e-17)
    assert step_record(res, st.layer, 0, 2, None, keys=96).violations == 0
    res.true_tv.view(-1)[0] = 2 * slack
    assert step_record(res, st.layer, 0, 2, None, keys=96).violations == 1
