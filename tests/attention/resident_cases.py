"""Shared cases of the resident-set tests: the eviction policies a resident set is selected by, prompts, a greedy
decode through a cache, and the per-cell soundness checks of a validate-mode run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from kvcert import EvictionConfig, Gate, StorageConfig
from kvcert.attention.resident import ResidentRecord
from kvcert.cache.telemetry import Telemetry
from kvcert.evict import H2O, RMM, SnapKV, StreamingLLM
from kvcert.evict.base import EvictionPolicy
from kvcert.integrations.transformers import CertifiedCache

PROMPT = 40
#: the resident set's selection policies, small enough windows for the tiny models' 40-token prompts
POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "streaming": lambda: StreamingLLM(sinks=2),
    "h2o": lambda: H2O(recent=3),
    "snapkv": lambda: SnapKV(window=3, kernel=3),
    "rmm": lambda: RMM(lag=3, kappa="uniform"),
}


def prompt_ids(model, n: int = PROMPT, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """``[batch, n]`` random token ids (no special tokens) from a seeded generator."""
    return torch.randint(3, model.config.vocab_size, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy_decode(model, ids: torch.Tensor, cache, steps: int, each: Callable | None = None) -> torch.Tensor:
    """Prefill ``ids`` into ``cache``, then ``steps`` greedy tokens ``[batch, steps]``; ``each(cache)`` after every
    decode forward."""
    out = model(ids, cache=cache, use_cache=True)
    toks = []
    for _ in range(steps):
        nxt = out.logits[:, -1:].argmax(-1)
        toks.append(nxt)
        out = model(nxt, cache=cache, use_cache=True)
        if each is not None:
            each(cache)
    return torch.cat(toks, 1)


def assert_sound_in_every_cell(tel) -> None:
    """Validate-mode telemetry of a resident run, checked per recorded (step, layer, row, query head) cell: true TV
    against attention over EVERY token (omitted ones too) <= certificate, true output error <= output bound, exact
    omitted mass <= its bound; and the omitted tokens matter (some true TV > 0.2), so a certificate blind to them
    would have been caught."""
    rec = tel.recorded
    assert tel.cells > 0
    assert tel.violations == 0 and tel.out_violations == 0 and tel.recall_violations == 0
    assert bool((tel.true_tv[rec] <= tel.certificates[rec]).all())
    assert tel.true_out_err is not None and tel.out_bound is not None
    assert bool((tel.true_out_err[rec] <= tel.out_bound[rec]).all())
    live = ~torch.isnan(tel.omitted_mass_bound)
    assert bool(live.any()) and bool((tel.omitted_mass[live] <= tel.omitted_mass_bound[live]).all())
    assert float(tel.true_tv[rec].max()) > 0.2


def assert_recall_above_its_floor(records: list[ResidentRecord], gate: Gate) -> None:
    """Per resident read of a validate-mode run: with the gate on, the recall floor is recorded and the read paged in
    at least that much (keys, values, dense fallbacks; a read certified with less served a bound below the exact
    omitted mass, ``kvcert.attention.recall_floor``); with the gate off, no floor is recorded."""
    assert records
    for rec in records:
        if gate.mode == "off":
            assert rec.bytes_floor is None
            continue
        assert rec.bytes_floor is not None
        assert rec.bytes_floor <= rec.bytes_keys + rec.bytes_values + rec.bytes_dense, (rec.step, rec.layer)


def resident_cache(
    model,
    codec: str,
    policy: str,
    gate: Gate | None,
    validate: bool = False,
    storage: StorageConfig | None = None,
    resident: float = 0.25,
    page_size: int = 4,
    **options,
) -> CertifiedCache:
    """The resident cache of these tests: ``R = resident`` (0.25), pages of ``page_size`` (4), ``codec`` keys and
    values (in ``storage`` when given), ``POLICIES[policy]`` selection, ``gate`` (``None``: the cache's default),
    ``options`` added to the resident set."""
    storage = dataclasses.replace(storage or StorageConfig(), keys=codec, values=codec)
    kept = EvictionConfig.resident_set(resident, select=POLICIES[policy](), page_size=page_size, **options)
    return CertifiedCache(model, gate=gate, validate=validate, storage=storage, eviction=kept)


#: the gate of the validate-mode runs of :func:`validated_runs`
TAU = 0.3


def validated_runs(
    model, ids: torch.Tensor, codec: str, policy: str, steps: int, storage: StorageConfig | None = None, **options
) -> Iterator[tuple[Gate, Telemetry]]:
    """Decode ``steps`` greedy tokens after ``ids`` through a validate-mode resident cache (``R = 0.25``, pages of 4,
    ``codec`` keys and values in ``storage``, ``POLICIES[policy]`` selection, ``options`` added) twice: ungated, then at
    ``Gate.certified(TAU)``. Each run is checked per cell (:func:`assert_sound_in_every_cell`); the gated run must
    serve every cell at most ``TAU`` and page in, read by read, at least the recall floor
    (:func:`assert_recall_above_its_floor`). Yields each run's gate and telemetry."""
    for gate in (Gate.off(), Gate.certified(TAU)):
        with resident_cache(model, codec, policy, gate, True, storage, **options) as cache:
            greedy_decode(model, ids, cache, steps)
            tel = cache.telemetry()
            records = list(cache.resident_records)
        assert_sound_in_every_cell(tel)
        assert_recall_above_its_floor(records, gate)
        if gate.mode == "certified":
            assert bool((tel.served[tel.recorded] <= TAU).all())
        yield gate, tel
