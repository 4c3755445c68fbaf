"""Step records reduce a read's cells to its worst query when read, and stack per (step, layer)."""

from __future__ import annotations

import pytest
import torch

from kvcert.cache.telemetry import StepRecord, stack_records


def _record(step: int, q: int, seed: int) -> StepRecord:
    g = torch.Generator().manual_seed(seed)
    cells = {
        name: torch.rand(1, 6, q, generator=g, dtype=torch.float64)
        for name in ("cert", "raw", "served", "tanh", "out_bound")
    }
    cells.update(tier_b=None, true_tv=None, true_out_err=None)
    heads = (torch.tensor([[False, True]]), torch.tensor([[0, 0]]), torch.tensor([[False, False]]))
    return StepRecord(step=step, layer=0, cells=cells, heads=heads, queries=q)


def test_readings_are_the_worst_query_and_stack_per_step():
    prefill, decode = _record(0, 5, 1), _record(1, 1, 2)
    assert torch.equal(prefill.reading("cert"), prefill.cells["cert"].amax(-1))
    assert torch.equal(decode.reading("out_bound"), decode.cells["out_bound"][..., 0])
    assert prefill.reading("tier_b") is None and prefill.reading("witness") is None  # no chain inputs
    assert prefill.reading("repaired").tolist() == [[False, True]]
    stacked = stack_records([prefill, decode], layers=1, steps=2, attr="raw")
    assert stacked.shape == (2, 1, 1, 6)
    assert torch.equal(stacked[0, 0], prefill.cells["raw"].amax(-1))
    assert torch.equal(stacked[1, 0], decode.cells["raw"][..., 0])
    assert stack_records([prefill], layers=1, steps=1, attr="true_tv") is None
    with pytest.raises(ValueError, match="unknown step reading"):
        prefill.reading("certificate")
