"""The whole CertifiedCache on the Triton read over packed codes (interpreter), for a SmolLM2-shaped tiny model
(Llama attention, 3 query heads per KV head) and every codec the kernels decode in registers: validate mode with
zero violations per cell, ``Gate.certified(tau=0)`` token-exact against ``DynamicCache``, block repair."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcert import Gate, StorageConfig, kernels, quant
from kvcert.integrations.transformers import CertifiedCache
from kvcert.kernels import triton_read
from kvcert.kernels.packed import MODES
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)

#: SmolLM2-135M's attention shape, shrunk: Llama, GQA with 3 query heads per KV head, RoPE, tied embeddings
SMOLLM2_SHAPE = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32}


def _codec(name: str) -> quant.Codec:
    """Codecs with short blocks and windows, so a 24-token prompt is mostly encoded."""
    if name.startswith("kivi"):
        return quant.get(name, group_size=8, residual_window=4)
    return quant.get(name, group_size=16) if name in ("int2", "int4", "int8", "dither-int8") else quant.get(name)


@pytest.fixture
def packed_reads(monkeypatch) -> list[tuple[int, int]]:
    """Force the Triton backend; record the (key, value) mode of every read it serves."""
    monkeypatch.setenv(kernels.ENV, "triton")
    modes: list[tuple[int, int]] = []
    real = triton_read.decode_read

    def recorded(*args, **kwargs):
        modes.append((kwargs["k_tiles"].mode, kwargs["v_tiles"].mode))
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_read, "decode_read", recorded)
    return modes


def _generate(model, ids, cache, steps):
    out = model.generate(ids, cache=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize(("keys", "values"), [("int8", "kivi-4"), ("int4", "dither-int8"), ("int2", "none")])
def test_tau0_is_token_exact_and_validate_has_no_violation_on_packed_codes(keys, values, packed_reads) -> None:
    """Batch 2, a 24-token prompt then 3 decode reads per layer: every cell's certificate at least the true TV
    and output bound at least the output error (validate), every head repaired at tau = 0 and the tokens those
    of ``DynamicCache``; every read decodes both codecs' codes in registers."""
    model = tiny_random("llama", **SMOLLM2_SHAPE)
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(4))
    ref = _generate(model, ids, DynamicCache(config=model.config), 4)
    cache = CertifiedCache(
        model,
        gate=Gate.certified(0.0),
        validate=True,
        seed=1,
        storage=StorageConfig(keys=_codec(keys), values=_codec(values), write_block=4),
    )
    got = _generate(model, ids, cache, 4)
    cache.detach()
    tel = cache.telemetry()
    rec = tel.recorded
    assert torch.equal(ref, got)
    assert tel.violations == 0 and tel.out_violations == 0, tel.summary()
    assert torch.all(tel.true_tv[rec] <= tel.certificates[rec]) and bool(rec.any())
    assert tel.fallback_rate == 1.0
    want = (MODES[_mode_name(keys)], MODES[_mode_name(values)])
    assert len(packed_reads) >= 3 * len(cache.layers) and set(packed_reads) == {want}


def _mode_name(codec: str) -> str:
    return {
        "int8": "rtn8",
        "dither-int8": "dither",
        "kivi-2": "kivi_tokens",
        "kivi-4": "kivi_tokens",
        "none": "fp16",
    }.get(codec, "rtn_packed")


def test_block_repair_under_a_threshold_on_packed_codes(packed_reads) -> None:
    model = tiny_random("llama", **SMOLLM2_SHAPE)
    ids = torch.randint(3, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(5))
    gate = Gate.certified(0.02, granularity="block", block_size=8)
    cache = CertifiedCache(
        model, gate=gate, validate=True, seed=2, storage=StorageConfig(keys="int2", values="int4", write_block=4)
    )
    _generate(model, ids, cache, 4)
    cache.detach()
    tel = cache.telemetry()
    rec = tel.recorded
    assert tel.violations == 0 and tel.out_violations == 0, tel.summary()
    assert torch.all(tel.served[rec] <= 0.02 + 1e-12) and 0 < tel.fallback_rate
    assert torch.all(tel.true_out_err[rec] <= tel.out_bound[rec])
    assert packed_reads and all(m == (MODES["rtn_packed"], MODES["rtn_packed"]) for m in packed_reads)
