"""Every tensor the eviction, resident-read and recall paths create is created on the device of their inputs.

A CUDA cache must never mix in a CPU tensor made by a factory call that forgot its ``device=`` (``torch.zeros(n)``
beside CUDA keys: a device error at best, a silent host round trip at worst). No GPU is needed to check it: the runs
below go through :class:`FactoryRecorder`, a ``TorchFunctionMode`` that records every tensor factory
(``torch.zeros``, ``arange``, ``full``, ``tensor``, ...) called from the paths under test without an explicit
``device=``, and each test requires that record to be empty. A device-less factory call added to any of those modules
fails the test with its file and line (``test_the_recorder_catches_a_device_less_factory`` plants one).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from resident_cases import POLICIES, greedy_decode, prompt_ids
from torch.overrides import TorchFunctionMode

from kvcert import EvictionConfig, Gate, StorageConfig
from kvcert.cache import recall
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)

SRC = Path(__file__).resolve().parents[2] / "src" / "kvcert"
#: the modules whose tensors must follow their inputs' device: eviction orchestration, the resident read, the cache
#: stores and buffers, the recall pool, the eviction policies and the page bounds of the resident certificate
WATCHED = (
    SRC / "attention" / "evict_driver.py",
    SRC / "attention" / "resident.py",
    SRC / "attention" / "read_path.py",
    SRC / "cache",
    SRC / "evict",
    SRC / "bounds" / "pages.py",
)
#: tensor factories: each places its result on the default device unless given ``device=``
FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.tensor,
    torch.as_tensor,
    torch.eye,
    torch.linspace,
    torch.logspace,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.scalar_tensor,
    torch.empty_strided,
    torch.tril_indices,
    torch.triu_indices,
}
_TORCH = Path(torch.__file__).resolve().parent


class FactoryRecorder(TorchFunctionMode):
    """Records ``file:line`` of every factory call without ``device=`` whose caller is a module of ``watched``
    (files or folders)."""

    def __init__(self, watched: tuple[Path, ...] = WATCHED) -> None:
        super().__init__()
        self.watched = watched
        self.calls: list[str] = []

    def _watched(self, path: Path) -> bool:
        return any(path == w or w in path.parents for w in self.watched)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            frame = sys._getframe(1)
            while frame is not None and _TORCH in Path(frame.f_code.co_filename).resolve().parents:
                frame = frame.f_back
            if frame is not None:
                path = Path(frame.f_code.co_filename).resolve()
                if self._watched(path):
                    self.calls.append(f"{path.relative_to(SRC.parent)}:{frame.f_lineno} torch.{func.__name__}")
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def model():
    return tiny_random("llama", head_dim=32)


def _decode(model, cache, steps: int = 4) -> None:
    greedy_decode(model, prompt_ids(model, batch=2), cache, steps)


def _record(model, watched: tuple[Path, ...] = WATCHED, write_block: int = 16, **kw) -> list[str]:
    storage = StorageConfig(keys="int4", values="int4", write_block=write_block)
    with CertifiedCache(model, storage=storage, **kw) as cache, FactoryRecorder(watched) as rec:
        _decode(model, cache)
        cache.telemetry()
    return sorted(set(rec.calls))


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("mode", ["budget", "compression", "budget-validate-belady"])
def test_eviction_creates_tensors_on_the_inputs_device(model, policy, mode):
    belady = mode == "budget-validate-belady"
    if mode == "compression":
        eviction = EvictionConfig.prefill(POLICIES[policy](), 0.5)
    else:
        eviction = EvictionConfig.decode_budget(POLICIES[policy](), 24, belady=belady)
    assert _record(model, gate=Gate.certified(0.2), validate=belady, eviction=eviction) == []


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize(
    ("recall", "summary", "tau"),
    [
        ("persistent", "int8", 0.1),
        ("transient", "box", 0.1),
        ("persistent", "int8", 0.0),
        ("transient", "int8", 0.02),
        ("persistent", "basis8", 0.1),
    ],
)
def test_resident_reads_and_recall_create_tensors_on_the_inputs_device(model, policy, recall, summary, tau):
    """Resident reads with recall (persistent pool or transient), every summary kind, the dense fallback (τ = 0) and the
    exact resident entries, in validate mode (the exact omitted mass and true TV beside every read)."""
    calls = _record(
        model,
        gate=Gate.certified(tau),
        validate=True,
        eviction=EvictionConfig.resident_set(
            0.25, select=POLICIES[policy](), page_size=4, recall=recall, summary=summary
        ),
    )
    assert calls == []


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_resident_reselection_creates_tensors_on_the_inputs_device(model, policy):
    """Periodic re-selection of the resident set (promotions from the host tier, rebuilt page summaries, held pages
    carried over) in validate mode, with persistent recall."""
    calls = _record(
        model,
        gate=Gate.certified(0.1),
        validate=True,
        eviction=EvictionConfig.resident_set(0.25, select=POLICIES[policy](), page_size=4, reselect=2),
    )
    assert calls == []


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"streaming"}))
def test_resident_mass_allocation_creates_tensors_on_the_inputs_device(model, policy):
    """The per-layer split of the resident set (``resident_alloc="mass"``: every layer's scores, the global top-k,
    the deferred gathers) with re-selection at each layer's fraction and persistent recall, in validate mode."""
    calls = _record(
        model,
        gate=Gate.certified(0.1),
        validate=True,
        eviction=EvictionConfig.resident_set(
            0.25, select=POLICIES[policy](), page_size=4, reselect=2, resident_alloc="mass"
        ),
    )
    assert calls == []


@pytest.mark.parametrize("alloc", ["uniform", "mass"])
def test_a_resident_set_on_a_sliding_window_model_creates_tensors_on_the_inputs_device(alloc):
    """A tiny Gemma-3 (sliding layers of window 16 around full-attention ones, 40-token prompts): the resident set on
    the full layers, the sliding layers' trimmed windows, re-selection and persistent recall, in validate mode."""
    gemma = tiny_random("gemma3", num_hidden_layers=3, head_dim=32, num_key_value_heads=2, sliding_window=16)
    calls = _record(
        gemma,
        write_block=4,
        gate=Gate.certified(0.1),
        validate=True,
        eviction=EvictionConfig.resident_set(
            0.25, select=POLICIES["snapkv"](), page_size=4, reselect=2, resident_alloc=alloc
        ),
    )
    assert calls == []


@pytest.mark.parametrize(
    "kw",
    [
        {"gate": Gate.certified(0.05)},
        {"gate": Gate.certified(0.05, granularity="block", persistent=True), "validate": True},
        {"gate": Gate.risk_ranked(2.0)},
        {"ladder": True},
    ],
    ids=["head", "block-persistent-validate", "risk-ranked", "ladder"],
)
def test_every_kvcert_module_on_the_certified_read_path_follows_its_inputs(model, kw):
    """The certified read itself (served read, gate, head and block repair, validate mode, the ladder), the codecs'
    bit packing and the cache's writes: no device-less factory anywhere in kvcert."""
    assert _record(model, (SRC,), **kw) == []


def test_the_recorder_catches_a_device_less_factory(monkeypatch):
    """A planted ``torch.zeros(n)`` in a watched module is reported with its place; one with ``device=`` is not."""
    real = recall.HeldPages.empty.__func__

    def planted(cls, batch, heads, counts, page_size, dims, host, pool):
        torch.zeros(3)  # the planted break
        torch.zeros(3, device=counts.device)
        return real(cls, batch, heads, counts, page_size, dims, host, pool)

    planted.__code__ = planted.__code__.replace(co_filename=recall.__file__)
    monkeypatch.setattr(recall.HeldPages, "empty", classmethod(planted))
    with FactoryRecorder() as rec:
        recall.HeldPages.empty(1, 1, torch.ones(2, dtype=torch.int64), 4, (2, 2), torch.float32, recall.RecallPool())
    assert len(rec.calls) == 1 and rec.calls[0].startswith("kvcert/cache/recall.py:")
