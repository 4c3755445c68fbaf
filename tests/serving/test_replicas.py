"""Replica ranks (spawned processes, one ledger each) stay coupled; the gate's replica criteria catch a missing
rank, rank 0 alone, a differing field and a rank-dependent dither seed."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
from replica_seeds import rank_dependent_seed
from typer.testing import CliRunner

from kvcert import StorageConfig
from kvcert.cli.ledger_command import app
from kvcert.ledger import diff_states, evaluate, replay
from kvcert.models.tiny import tiny_random
from kvcert.serving.replicas import ReplicaConfig, ReplicaGroup, rank_dir

PROMPTS = [[(7 * i + 5 * j) % 250 + 3 for j in range(4 + 3 * i)] for i in range(3)]
LENGTHS = [3, 4, 2]


def _run(out: Path, n_ranks: int, **kw) -> tuple[list[dict], dict[int, list[list[int]]]]:
    cfg = ReplicaConfig(
        functools.partial(tiny_random, "llama", head_dim=32),
        n_ranks,
        out,
        nonce=2**40 + 17,
        cache_options={"storage": StorageConfig(write_block=1)},
        timeout_s=300,
        **kw,
    )
    with ReplicaGroup(cfg) as group:
        tokens = group.serve(PROMPTS, LENGTHS)
        group.serve(PROMPTS[:2], [2, 2])  # a second batch: UIDs 3, 4
    snaps = [json.loads((rank_dir(out, r) / "ledger.json").read_text()) for r in range(n_ranks)]
    return snaps, tokens


@pytest.fixture(scope="module")
def coupled(tmp_path_factory) -> tuple[Path, list[dict], dict[int, list[list[int]]]]:
    out = tmp_path_factory.mktemp("replicas")
    snaps, tokens = _run(out, 3)
    return out, snaps, tokens


def _failed(result) -> dict[str, str]:
    return {c.name: c.observed for c in result.criteria if not c.passed}


def test_coupled_ranks_pass_every_criterion(coupled):
    out, snaps, tokens = coupled
    assert [s["rank"] for s in snaps] == [0, 1, 2] and {s["n_ranks"] for s in snaps} == {3}
    assert tokens[0] == tokens[1] == tokens[2] and [len(t) for t in tokens[0]] == LENGTHS
    res = evaluate(snaps, n_user_requests=5)
    assert res.passed, _failed(res)
    observed = {c.name: c.observed for c in res.criteria}
    assert observed["n_ranks_seen==n_ranks"].startswith("3 of 3")
    assert snaps[0]["eprocess"]["n_factors"] > 0  # the dither really drew: probabilistic events on every rank
    assert all(a["n_prob_events"] > 0 for a in snaps[0]["accounts"].values())
    for r in range(3):  # each rank's log replays to its own snapshot, rank id included
        rebuilt = json.loads(json.dumps(replay(rank_dir(out, r) / "ledger.db").snapshot()))
        assert diff_states(snaps[r], rebuilt) == []
    result = CliRunner().invoke(app, ["gate", str(out), "--requests", "5"])
    assert result.exit_code == 0, result.output
    assert "PASS  replica_coupling_identical" in result.output


def test_missing_rank_and_rank_zero_alone_fail(coupled, tmp_path):
    out, snaps, _ = coupled
    res = evaluate([snaps[0], snaps[2]], n_user_requests=5)
    assert set(_failed(res)) == {"n_ranks_seen==n_ranks"} and "missing [1]" in _failed(res)["n_ranks_seen==n_ranks"]
    res = evaluate(snaps[0], n_user_requests=5)  # rank 0 alone: "identical" would be trivially true
    assert set(_failed(res)) == {"n_ranks_seen==n_ranks"}
    assert {c.name: c for c in res.criteria}["replica_coupling_identical"].observed.startswith("trivially")
    partial = tmp_path / "run"
    shutil.copytree(out, partial)
    shutil.rmtree(partial / "rank1")
    result = CliRunner().invoke(app, ["gate", str(partial)])
    assert result.exit_code == 1 and "FAIL  n_ranks_seen==n_ranks" in result.output


def test_a_differing_field_fails_naming_rank_and_field(coupled):
    _, snaps, _ = coupled
    bad = json.loads(json.dumps(snaps))
    bad[2]["accounts"]["3"]["n_compressed"] += 1
    observed = _failed(evaluate(bad, n_user_requests=5))
    assert set(observed) == {"replica_coupling_identical"}
    assert "rank 2: account 3 n_compressed" in observed["replica_coupling_identical"]


def test_rank_dependent_seed_fails_coupling(tmp_path):
    snaps, tokens = _run(tmp_path, 2, seed_fn=rank_dependent_seed)
    observed = _failed(evaluate(snaps, n_user_requests=5))
    # every logical criterion still passes on rank 0: only the coupling catches the bug
    assert set(observed) == {"replica_coupling_identical"}
    assert "rank 1: account 0 eprocess.log_m" in observed["replica_coupling_identical"]
    assert [len(t) for t in tokens[1]] == LENGTHS
