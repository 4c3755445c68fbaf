"""The bit-allocation rule and its stored form (:mod:`kvcert.quant.bit_allocation`)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from kvcert.quant import Allocation, bytes_per_token_head, get, resolve
from kvcert.quant.bit_allocation import choose_key_bits, choose_values
from kvcert.quant.dither import DitherCodec
from kvcert.quant.per_head import PerHeadCodec


def _cov(**rows):
    return {int(b.removeprefix("b")): torch.tensor(v, dtype=torch.float64) for b, v in rows.items()}


def test_key_bits_take_the_narrowest_width_within_max_loss_of_the_widest():
    cov = _cov(
        b8=[[0.90, 0.50, 1.00]],
        b6=[[0.89, 0.10, 0.97]],
        b5=[[0.50, 0.49, 0.99]],
        b4=[[0.88, 0.00, 0.30]],  # head 0: 4 bits qualify while 5 do not — the narrowest qualifying width wins
    )
    assert choose_key_bits(cov, 0.02) == ((4, 5, 5),)
    assert choose_key_bits(cov, 0.0) == ((8, 8, 8),)  # only coverage at or above the widest's
    assert choose_key_bits(cov, 1.0) == ((4, 4, 4),)
    # the widest width always qualifies
    assert choose_key_bits(_cov(b8=[[0.0, 0.3]], b3=[[0.0, 0.2]]), 0.05) == ((3, 8),)


def test_key_bits_refuse_bad_inputs():
    with pytest.raises(ValueError, match="max_loss"):
        choose_key_bits(_cov(b8=[[1.0]]), -0.1)
    with pytest.raises(ValueError, match="no candidate"):
        choose_key_bits({}, 0.1)
    with pytest.raises(ValueError, match="same cells"):
        choose_key_bits(_cov(b8=[[1.0]], b6=[[1.0, 1.0]]), 0.1)
    with pytest.raises(ValueError, match=r"shares in \[0, 1\]"):
        choose_key_bits(_cov(b8=[[float("nan")]]), 0.1)
    with pytest.raises(ValueError, match="dithered widths"):
        choose_key_bits(_cov(b7=[[1.0]]), 0.1)
    with pytest.raises(ValueError, match=r"\[layers, KV heads\]"):
        choose_key_bits(_cov(b8=[1.0]), 0.1)


def test_values_take_the_fewest_measured_bytes_within_max_loss_of_the_costliest():
    """Per (layer, KV head), among codecs within ``max_loss`` of the costliest's share, the fewest bytes; kivi-2 is
    costed as the value codec it is (per token, 24 B at D = 64), not as its per-channel key form."""
    share = {
        "int8": torch.tensor([[1.0, 1.0], [0.6, 0.3]]),
        "int4": torch.tensor([[0.99, 0.5], [0.6, 0.3]]),
        "int2": torch.tensor([[0.2, 0.1], [0.59, 0.0]]),
        "kivi-2": torch.tensor([[0.2, 0.1], [0.59, 0.3]]),
    }
    assert bytes_per_token_head(resolve("int2", "value")) < bytes_per_token_head(resolve("kivi-2", "value"))
    assert bytes_per_token_head(resolve("kivi-2", "value")) < bytes_per_token_head(get("int4"))
    assert choose_values(share, 0.02) == (("int4", "int8"), ("int2", "kivi-2"))
    assert choose_values(share, 0.0) == (("int8", "int8"), ("int4", "kivi-2"))
    with pytest.raises(ValueError, match="unknown value codecs"):
        choose_values({"int9": torch.tensor([[1.0]])}, 0.1)
    with pytest.raises(ValueError, match=r"\[layers, KV heads\]"):
        choose_values({"int8": torch.tensor([1.0])}, 0.1)


def test_allocation_codecs_bytes_and_json_round_trip(tmp_path):
    alloc = Allocation(((8, 6, 3), (5, 5, 4)), ("int4", "int2"), tau=0.2, max_loss=0.02, provenance={"model": "x"})
    assert alloc.values == (("int4",) * 3, ("int2",) * 3)  # a name stands for every KV head of its layer
    assert alloc.value_codecs() == ("int4", "int2")
    codecs = alloc.key_codecs()
    assert [c.head_bits for c in codecs] == [(8, 6, 3), (5, 5, 4)]
    assert isinstance(codecs[0], DitherCodec) and codecs[0].heads == 3
    assert alloc.mean_key_bits() == pytest.approx(31 / 6)
    want = sum(3 * bytes_per_token_head(c) for c in codecs) + 3 * sum(
        bytes_per_token_head(get(v)) for v in ("int4", "int2")
    )
    assert alloc.bytes_per_token() == want
    path = tmp_path / "a.json"
    alloc.save(path)
    assert Allocation.load(path) == alloc
    for bad in ({"key_bits": [[8]]}, {**json.loads(json.dumps(asdict(alloc))), "key_bits": [["x"]]}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="not a kvcert allocation"):
            Allocation.load(path)
    mixed = Allocation(((8, 6, 3),), (("int8", "kivi-2", "int8"),), tau=0.2, max_loss=0.02)
    (per_head,) = mixed.value_codecs()
    assert isinstance(per_head, PerHeadCodec) and per_head.name == "mixed[int8,kivi-2,int8]"
    cost = sum(bytes_per_token_head(resolve(v, "value")) for v in ("int8", "kivi-2", "int8"))
    assert mixed.bytes_per_token() == 3 * bytes_per_token_head(mixed.key_codecs()[0]) + cost
    mixed.save(path)
    assert Allocation.load(path) == mixed
    per_layer = {**json.loads(json.dumps(asdict(alloc))), "values": ["int4", "int2"]}  # a file from before per head
    path.write_text(json.dumps(per_layer))
    assert Allocation.load(path) == alloc
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a kvcert allocation"):
        Allocation.load(path)


@pytest.mark.parametrize(
    ("key_bits", "values", "match"),
    [
        (((8, 6),), ("int4", "int4"), "same layers"),
        ((), (), "same layers"),
        (((8, 7),), ("int4",), "dithered widths"),
        (((8,),), ("int9",), "unknown codecs"),
        (((8, 6),), (("int4",),), "one value codec per KV head"),
        (((8, 6),), (("int4", 3),), "one value codec per KV head"),
    ],
)
def test_allocation_refuses_malformed_fields(key_bits, values, match):
    with pytest.raises(ValueError, match=match):
        Allocation(key_bits, values, tau=0.2, max_loss=0.0)
