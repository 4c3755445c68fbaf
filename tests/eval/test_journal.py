import json
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch

from kvcert import CertifiedCache
from kvcert.eval.journal import Journal, JournalRow, sample_key
from kvcert.models import tiny_random

CONFIG = {"model": "tiny:llama", "tasks": ("niah_single_1",), "context": 512, "seed": 3}


@pytest.fixture(scope="module")
def telemetry():
    """A real Telemetry (tiny model, a prefill and two decode steps through a certified int4 cache)."""
    model = tiny_random("llama", seed=0, head_dim=32)
    cache = CertifiedCache(model, keys="int4", values="int4", seed=0)
    ids = torch.randint(0, model.config.vocab_size, (1, 24))
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
        for _ in range(2):
            out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    cache.detach()
    return cache.telemetry()


def _row(task="niah_single_1", index=0, score=1.0):
    return JournalRow(task, index, {"dense": 1.0, "int4": score}, {"dense": " 123", "int4": " 12"})


def test_round_trip_keeps_rows_and_telemetry(tmp_path, telemetry):
    j = Journal(tmp_path / "j", CONFIG)
    j.append(_row(index=0), {"int4": telemetry})
    j.append(_row(index=1, score=0.0), {"int4": telemetry})
    again = Journal(tmp_path / "j", dict(CONFIG))  # reopened: tuples and lists compare equal after JSON
    rows = again.rows()
    assert [r.key for r in rows] == [sample_key("niah_single_1", 0), sample_key("niah_single_1", 1)]
    assert rows[1].scores == {"dense": 1.0, "int4": 0.0} and rows[1].predictions["int4"] == " 12"
    assert again.done() == {"niah_single_1-0", "niah_single_1-1"}
    tel = again.telemetry(rows[0])["int4"]
    assert torch.equal(tel.certificates.nan_to_num(-1), telemetry.certificates.nan_to_num(-1))
    assert (tel.bytes_device, tel.bytes_fp16, tel.bytes_paged) == (
        telemetry.bytes_device,
        telemetry.bytes_fp16,
        telemetry.bytes_paged,
    )


def test_other_config_is_refused_naming_the_keys(tmp_path):
    Journal(tmp_path / "j", CONFIG)
    with pytest.raises(ValueError, match=r"different config \(keys \['seed'\]\)"):
        Journal(tmp_path / "j", {**CONFIG, "seed": 4})
    with pytest.raises(ValueError, match=r"keys \['validate'\]"):
        Journal(tmp_path / "j", {**CONFIG, "validate": True})


def test_duplicate_and_unscored_variants_are_refused(tmp_path, telemetry):
    j = Journal(tmp_path / "j", CONFIG)
    j.append(_row(), {"int4": telemetry})
    with pytest.raises(ValueError, match="already in journal"):
        j.append(_row(), {"int4": telemetry})
    with pytest.raises(ValueError, match=r"without a score: \['int2'\]"):
        j.append(_row(index=5), {"int2": telemetry})
    assert len(j.rows()) == 1
    assert not list((tmp_path / "j" / "telemetry").glob(".*.tmp"))  # the refused write left no temp file


def test_torn_last_line_is_dropped_and_the_sample_redone(tmp_path, telemetry):
    j = Journal(tmp_path / "j", CONFIG)
    j.append(_row(index=0), {"int4": telemetry})
    with open(j.samples_file, "a", encoding="utf-8") as fh:  # a process died inside the write of sample 1
        fh.write('{"task": "niah_single_1", "index": 1, "sco')
    assert Journal(tmp_path / "j", CONFIG).done() == {"niah_single_1-0"}
    assert j.samples_file.read_text(encoding="utf-8").endswith("}\n")
    j.append(_row(index=1), {"int4": telemetry})  # redone and appended after the intact lines
    lines = j.samples_file.read_text(encoding="utf-8").splitlines()
    assert [json.loads(x)["index"] for x in lines] == [0, 1]


def _work(path, out):
    """A worker: claim and journal every sample it can of 40; report which it did."""
    j = Journal(path, CONFIG)
    mine = [i for i in range(40) if j.claim(sample_key("niah_single_1", i))]
    for i in mine:
        j.append(_row(index=i), {})
    out.put(mine)


def test_concurrent_workers_claim_disjoint_samples_and_journal_each_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_work, args=(tmp_path / "j", out)) for _ in range(3)]
    for p in procs:
        p.start()
    done = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert sorted(i for d in done for i in d) == list(range(40))  # every sample by exactly one worker
    assert sorted(r.index for r in Journal(tmp_path / "j", CONFIG).rows()) == list(range(40))


def test_claims_respect_live_workers_and_take_over_dead_ones(tmp_path):
    j = Journal(tmp_path / "j", CONFIG)
    assert j.claim("niah_single_1-0") and j.claim("niah_single_1-0")  # ours: claimed again
    claims = tmp_path / "j" / "claims"
    (claims / "niah_single_1-1").write_text(str(os.getppid()))  # a live process holds it
    assert not j.claim("niah_single_1-1")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (claims / "niah_single_1-2").write_text(str(dead.pid))  # its worker died: taken over
    assert j.claim("niah_single_1-2")
    assert (claims / "niah_single_1-2").read_text() == str(os.getpid())
    j.append(_row(index=3), {})
    assert not j.claim("niah_single_1-3")  # journaled: nothing to claim
