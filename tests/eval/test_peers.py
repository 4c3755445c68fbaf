"""Peer caches (transformers' QuantizedCache, quanto backend): measured bytes, parsing, shared-prefill decode."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
import torch

from kvcert.eval.peers import PeerSpec, held_bytes, parse_peers, run_peers
from kvcert.models.tiny import tiny_random

pytest.importorskip("optimum.quanto")
torch.set_num_threads(1)


@pytest.mark.parametrize("name,bits", [("quanto-int4", 4), ("quanto-int2", 2)])
def test_held_bytes_are_packed_codes_plus_scales_and_residual(name, bits):
    model = tiny_random("llama", head_dim=64)  # float32 model: scales, shifts, residual in float32
    cache = PeerSpec(name, residual_length=8).build(model)
    k, v = torch.randn(1, 2, 100, 64), torch.randn(1, 2, 100, 64)
    cache.update(k, v, 0)  # first write: the whole prompt quantized, no residual
    per_row = 64 * bits // 8 + 2 * 4  # packed codes + one float32 scale and shift per group of 64
    assert held_bytes(cache) == 2 * (2 * 100) * per_row
    cache.update(k[:, :, :3], v[:, :, :3], 0)  # three tokens wait in the full-precision residual window
    assert held_bytes(cache) == 2 * (2 * 100) * per_row + 2 * (2 * 3 * 64 * 4)


def test_run_peers_decode_from_one_prefill_and_int2_holds_less():
    model = tiny_random("llama", head_dim=64)
    ids = torch.randint(3, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    r4, r2 = run_peers(model, ids, parse_peers("quanto-int4,quanto-int2", 16), 10, [])
    assert len(r4.tokens) == len(r2.tokens) == 10
    assert r2.bytes_device < r4.bytes_device < r4.bytes_fp16
    assert r4.bytes_fp16 == r2.bytes_fp16 == 2 * 2 * (200 + 9) * 2 * 64 * 2  # layers · Hkv · tokens · (K+V) · D · 2 B


def test_fp8_peer_holds_one_byte_per_element_plus_scales():
    model = tiny_random("llama", head_dim=64)
    cache = PeerSpec("fp8-e4m3").build(model)
    k, v = torch.randn(1, 2, 100, 64), torch.randn(1, 2, 100, 64)
    cache.update(k, v, 0)
    cache.update(k[:, :, :3], v[:, :, :3], 0)  # appended with the frozen scale, no residual window
    assert held_bytes(cache) == 2 * (2 * 103 * 64 + 4)
    assert PeerSpec("fp8-e4m3").label == "hf:fp8-e4m3" and PeerSpec("quanto-int2", 8).label == "hf:quanto-int2(r=8)"


def test_parse_peers_rejects_unknown_names_and_bad_window():
    assert parse_peers("") == []
    with pytest.raises(ValueError, match="peers"):
        parse_peers("quanto-int3")
    with pytest.raises(ValueError, match="residual-length"):
        parse_peers("quanto-int4", 0)


def test_missing_backend_names_the_extra_that_installs_it(monkeypatch):
    """The ImportError for a missing optimum-quanto names a pyproject extra that holds it (it named ``peers``,
    which does not exist)."""
    model, real = tiny_random("llama"), importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "optimum.quanto" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"kvcert\[\w+\]") as err:
        PeerSpec("quanto-int4").build(model)
    extra = re.search(r"kvcert\[(\w+)\]", str(err.value)).group(1)
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert any(dep.startswith("optimum-quanto") for dep in pyproject["project"]["optional-dependencies"][extra])
