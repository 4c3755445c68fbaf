"""Backend choice per read (``kvcert.kernels.active``) and the whole CertifiedCache on the Triton read path."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcert import Gate, StorageConfig, kernels
from kvcert.integrations.transformers import CertifiedCache
from kvcert.kernels import triton_read
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)


def test_active_defaults_overrides_and_errors(monkeypatch) -> None:
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert kernels.active("cpu") == "numba"
    assert kernels.active("cuda") == "triton"
    assert kernels.active("mps") == "torch"
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: None)  # a CUDA install without triton
    kernels._triton_installed.cache_clear()  # looked up once per process
    assert kernels.active("cuda") == "torch"
    monkeypatch.undo()
    kernels._triton_installed.cache_clear()
    monkeypatch.delenv(kernels.ENV, raising=False)
    for name in kernels.BACKENDS:
        monkeypatch.setenv(kernels.ENV, name)
        assert kernels.active("cpu") == name
    monkeypatch.setenv(kernels.ENV, "cuda-graphs")
    with pytest.raises(ValueError, match="KVCERT_KERNEL='cuda-graphs' is not a read-path backend"):
        kernels.active("cpu")
    monkeypatch.setenv(kernels.ENV, "numba")
    with pytest.raises(ValueError, match="CPU tensors only"):
        kernels.active("cuda")
    monkeypatch.setenv(kernels.ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kernels.active("cpu")


def _tiny(family: str):
    return tiny_random(family, head_dim=32)


def _decode_loop(model, ids, cache, steps):
    """Prefill ``ids`` then ``steps`` greedy tokens through ``cache``; returns the generated tokens."""
    out = model.generate(ids, cache=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1] :]


@pytest.fixture
def triton_reads(monkeypatch) -> list[int]:
    """Force the Triton backend and count the reads it serves (so a test cannot pass on another path)."""
    monkeypatch.setenv(kernels.ENV, "triton")
    calls: list[int] = []
    real = triton_read.decode_read

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_read, "decode_read", counted)
    return calls


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding-window layers, MQA
def test_repair_everything_is_token_identical_to_dynamic_cache(family, triton_reads) -> None:
    model = _tiny(family)
    ids = torch.randint(3, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    ref = _decode_loop(model, ids, DynamicCache(config=model.config), 4)
    cache = CertifiedCache(
        model, gate=Gate.certified(tau=0.0), storage=StorageConfig(keys="int2", values="int2", write_block=4)
    )
    got = _decode_loop(model, ids, cache, 4)
    cache.detach()
    assert torch.equal(ref, got)
    assert cache.telemetry().fallback_rate == 1.0 and len(triton_reads) >= 4


@pytest.mark.parametrize(
    ("family", "batch", "keys", "gate"),
    [("qwen2", 2, "int4", None), ("llama", 1, "int2", Gate.certified(0.05, granularity="block", block_size=8))],
)
def test_validate_mode_zero_violations_per_cell_on_triton(family, batch, keys, gate, triton_reads) -> None:
    """GQA (qwen2's tiny config groups query heads), batch 2, validate mode; block repair under a gate."""
    model = _tiny(family)
    ids = torch.randint(3, model.config.vocab_size, (batch, 24), generator=torch.Generator().manual_seed(1))
    cache = CertifiedCache(
        model, gate=gate, validate=True, seed=3, storage=StorageConfig(keys=keys, values="int4", write_block=4)
    )
    _decode_loop(model, ids, cache, 4)  # the prefill, then 3 decode reads per layer
    cache.detach()
    tel = cache.telemetry()
    rec = tel.recorded
    assert tel.violations == 0 and tel.out_violations == 0, tel.summary()
    assert torch.all(tel.true_tv[rec] <= tel.certificates[rec])
    assert torch.all(tel.true_out_err[rec] <= tel.out_bound[rec])
    if gate is not None:
        assert torch.all(tel.served[rec] <= 0.05 + 1e-12) and tel.fallback_rate > 0
    assert len(triton_reads) >= 3 * len(cache.layers)


def test_triton_and_numba_backends_certify_the_same_reads(monkeypatch) -> None:
    model = _tiny("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    certs = {}
    for name in ("numba", "triton", "torch"):
        monkeypatch.setenv(kernels.ENV, name)
        cache = CertifiedCache(model, seed=0, storage=StorageConfig(keys="int4", values="int8", write_block=4))
        _decode_loop(model, ids, cache, 3)
        cache.detach()
        certs[name] = cache.telemetry().certificates
    rec = ~torch.isnan(certs["numba"])
    for name in ("triton", "torch"):
        assert torch.equal(rec, ~torch.isnan(certs[name]))
        assert torch.allclose(certs[name][rec], certs["numba"][rec], rtol=1e-4, atol=1e-9), name
