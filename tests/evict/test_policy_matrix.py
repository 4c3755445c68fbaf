"""Every policy through the same checks (kvpress-style matrix) on random traces."""

from __future__ import annotations

import pytest
import torch
from evict_traces import POLICY_NAMES, make_policies, random_trace

from kvcert.evict import H2O, RMM, SnapKV, StreamingLLM, keep_top, prefill_kept_count, replay

BUDGETS = [8, 13]


@pytest.fixture(scope="module")
def trace():
    return random_trace(steps=40, layers=2, heads=3, seed=1)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_budget_protection_and_determinism(trace, name, budget):
    policy = make_policies(trace)[name]
    res = replay(policy, trace, budget)
    # budget never exceeded after a select; each read sees at most budget + 1 items (the new one)
    assert res.max_items <= budget
    assert int(res.present.sum(-1).max()) <= budget + 1
    # the new item is always present at its own read; nothing from the future is present
    steps = trace.steps
    idx = torch.arange(steps)
    assert res.present[idx, :, :, idx].all()
    assert not (res.present & torch.ones(steps, steps, dtype=torch.bool).triu(1)[:, None, None, :]).any()
    # nested kept sets: once evicted, an item never returns
    assert not (res.present[1:] & ~res.present[:-1] & (idx[None, :] < idx[1:, None])[:, None, None, :]).any()
    # protected items survive every select: sinks always, and positions > s - recent after step s
    for s in range(steps - 1):
        lo = max(0, s - policy.recent + 1)
        assert res.present[s + 1, :, :, lo : s + 1].all()
        assert res.present[s + 1, :, :, : min(policy.sinks, s + 1)].all()
    # deterministic: a second replay is identical
    again = replay(policy, trace, budget)
    assert torch.equal(again.present, res.present) and torch.equal(again.served_mass, res.served_mass)


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.7, 0.9])
def test_prefill_keeps_exact_count(trace, name, ratio):
    policy = make_policies(trace)[name]
    s, layer = 20, 1
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 3, s, 8, generator=g)
    attn = trace.attn[:s, layer, :, :s].permute(1, 0, 2)[None]  # [1, Hkv(=Hq), S, S]
    kappa = trace.kappa_of("realised")[:s][None]
    c = prefill_kept_count(s, ratio)
    protected = torch.arange(s)
    protected = (protected < policy.sinks) | (protected > s - 1 - policy.recent)
    if int(protected.sum()) > c and c < s:
        with pytest.raises(ValueError, match="budget"):
            policy.prefill_keep(layer, keys, keys.clone(), ratio, attn=attn, kappa=kappa)
        return
    keep = policy.prefill_keep(layer, keys, keys.clone(), ratio, attn=attn, kappa=kappa)
    assert keep.shape == (1, 3, c)
    assert (keep.diff(dim=-1) > 0).all() and int(keep.min()) >= 0 and int(keep.max()) < s
    kept = torch.zeros(1, 3, s, dtype=torch.bool).scatter_(-1, keep, True)
    assert kept[..., protected].all()


def test_prefill_kept_count_rule():
    assert [prefill_kept_count(10, r) for r in (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.95)] == [10, 9, 7, 5, 3, 1, 1]
    assert prefill_kept_count(7, 0.5) == 4  # removes floor(3.5) = 3
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="ratio"):
            prefill_kept_count(10, bad)


@pytest.mark.parametrize("policy", [StreamingLLM(sinks=1), H2O(recent=2), SnapKV(window=2, kernel=3), RMM(lag=2)])
def test_batch_rows_are_independent(policy):
    """A batch of two gives the same kept sets as each row alone (chunked q=3 reads, then decode)."""
    g = torch.Generator().manual_seed(5)
    rows = torch.softmax(torch.randn(2, 2, 12, 12, generator=g, dtype=torch.float64), -1)
    pos = torch.arange(12)

    def run(batch: slice) -> list[torch.Tensor]:
        policy.reset()
        kept, cur = [], torch.arange(3).expand(rows[batch].shape[0], 2, 3)
        for t in range(3, 13):
            q = 3 if t == 3 else 1
            cols = cur if t == 3 else torch.cat([cur, torch.full_like(cur[..., :1], t - 1)], -1)
            a = rows[batch][:, :, t - q : t, :].gather(-1, cols[:, :, None, :].expand(-1, -1, q, -1))
            policy.observe(0, a / a.sum(-1, keepdim=True), pos[cols] if cols.dim() == 3 else cols)
            policy.set_kappa(cols[:, 0, -q:], torch.full((cols.shape[0], q), 0.5, dtype=torch.float64))
            keep = policy.select(0, 5)
            cur = cols if keep is None else cols.gather(-1, keep)
            if keep is not None:
                policy.on_evict(0, keep)
            kept.append(cur.clone())
        return kept

    both = run(slice(0, 2))
    first, second = run(slice(0, 1)), run(slice(1, 2))
    for b, f, s in zip(both, first, second, strict=True):
        assert torch.equal(b, torch.cat([f, s]))


def test_bad_inputs_fail_closed():
    p = H2O(recent=2)
    attn = torch.full((1, 1, 1, 4), 0.25, dtype=torch.float64)
    with pytest.raises(ValueError, match="attn"):
        p.observe(0, attn[0], torch.arange(4)[None])
    with pytest.raises(ValueError, match="finite"):
        p.observe(0, attn * float("nan"), torch.arange(4)[None])
    with pytest.raises(ValueError, match="finite"):
        p.observe(0, attn * float("inf"), torch.arange(4)[None])
    with pytest.raises(ValueError, match="non-negative"):
        p.observe(0, -attn, torch.arange(4)[None])
    with pytest.raises(ValueError, match="increasing"):
        p.observe(0, attn, torch.tensor([[0, 2, 1, 3]]))
    with pytest.raises(ValueError, match="observed"):
        p.select(3, 2)
    p.observe(0, attn, torch.arange(4)[None])
    with pytest.raises(ValueError, match="budget"):
        p.select(0, 1)  # 2 protected > budget 1
    with pytest.raises(ValueError, match="keep"):
        p.on_evict(0, torch.tensor([[[2, 1]]]))
    with pytest.raises(ValueError, match="kappa"):
        p.set_kappa(torch.tensor([[3]]), torch.tensor([[1.5]]))
    with pytest.raises(ValueError, match="disagree"):
        p.observe(0, torch.full((1, 1, 1, 5), 0.2, dtype=torch.float64), torch.tensor([[0, 1, 3, 4, 5]]))
    with pytest.raises(ValueError, match="increasing"):
        p.observe(0, torch.full((1, 1, 1, 5), 0.2, dtype=torch.float64), torch.tensor([[0, 1, 2, 3, 3]]))
    with pytest.raises(ValueError, match="shrank"):
        p.observe(0, attn[..., :3], torch.arange(3)[None])
    with pytest.raises(ValueError, match="window"):
        SnapKV(window=0)
    with pytest.raises(ValueError, match="kernel"):
        SnapKV(kernel=4)
    with pytest.raises(ValueError, match="kappa"):
        RMM(lag=2, kappa="bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs attn"):
        H2O().prefill_keep(0, torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), 0.5)


def test_select_returns_none_within_budget_and_streaming_window_caps():
    p = StreamingLLM(sinks=1, window=2)
    attn = torch.full((1, 1, 1, 3), 1 / 3, dtype=torch.float64)
    p.observe(0, attn, torch.arange(3)[None])
    assert p.select(0, 3) is None
    p.reset()
    attn = torch.full((1, 1, 1, 6), 1 / 6, dtype=torch.float64)
    p.observe(0, attn, torch.arange(6)[None])
    assert p.select(0, 10).tolist() == [[[0, 4, 5]]]  # sinks + window, budget 10 notwithstanding


@pytest.mark.parametrize("n_evict", [1, 2, 5, 8, 9, 20])
def test_keep_top_fast_path_matches_stable_sort(n_evict):
    """Heavy ties (integer scores): the argmin path and the sort path keep the same, documented set."""
    g = torch.Generator().manual_seed(n_evict)
    s = 40
    scores = torch.randint(0, 4, (3, 2, s), generator=g).to(torch.float64)
    protected = torch.rand(3, 2, s, generator=g) < 0.2
    budget = s - n_evict
    keep = keep_top(scores, protected, budget)
    key = scores.masked_fill(protected, float("inf"))
    for b in range(3):
        for h in range(2):
            ranked = sorted(range(s), key=lambda i: (-key[b, h, i].item(), i))  # higher key, then lower index
            assert keep[b, h].tolist() == sorted(ranked[:budget])


def test_first_read_after_an_eviction_checks_every_held_slot():
    """A cache that gathered other slots than the policy's ``keep`` is caught at the next read, in any slot."""
    p = H2O(recent=1)
    row = torch.full((1, 1, 1, 5), 0.2, dtype=torch.float64)
    p.observe(0, row, torch.arange(5)[None])
    keep = p.select(0, 3)
    assert keep is not None
    p.on_evict(0, keep)
    assert p._state(0).positions[0, 0].tolist() == [0, 1, 4]  # equal scores: the lower slots win the ties
    q = torch.full((1, 1, 1, 4), 0.25, dtype=torch.float64)
    with pytest.raises(ValueError, match="disagree"):  # slot 1 is not the join slot: only the full check sees it
        p.observe(0, q, torch.tensor([[0, 2, 4, 5]]))
    p.observe(0, q, torch.tensor([[0, 1, 4, 5]]))
    assert p._state(0).positions[0, 0].tolist() == [0, 1, 4, 5]
