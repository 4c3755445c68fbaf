from __future__ import annotations

import torch

from kvcert.quant import kernel_env


def test_fused_plan_runs_where_the_read_path_runs_numba(monkeypatch):
    monkeypatch.delenv(kernel_env.ENV, raising=False)
    assert kernel_env.fused_log8(torch.device("cpu")) and not kernel_env.fused_log8(torch.device("meta"))
    monkeypatch.setenv(kernel_env.ENV, "torch")
    assert not kernel_env.fused_log8(torch.device("cpu"))
    monkeypatch.setenv(kernel_env.ENV, "numba")
    assert kernel_env.fused_log8(torch.device("cpu"))
