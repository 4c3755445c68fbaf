"""The greedy token-granular repair of ``benchmarks/tier_repair_pagein.py``: the count it returns passes the gate, a
read within τ needs none, one heavy token with a large radius is one token, and the count never exceeds the visible
tokens."""

import torch
from benchmark_scripts import load_benchmark

from kvcert.bounds import tv_box

trp = load_benchmark("tier_repair_pagein")
F64 = torch.float64


def _read(seed: int, g: int = 3, nq: int = 2, s: int = 40, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    exact = torch.randn(g, nq, s, generator=gen, dtype=F64) * 2
    radius = torch.rand(g, nq, s, generator=gen, dtype=F64) * scale
    served = exact + (torch.rand(g, nq, s, generator=gen, dtype=F64) * 2 - 1) * radius
    visible = torch.ones(g, nq, s, dtype=torch.bool)
    visible[:, 0, s - 5 :] = False  # the first read sees fewer tokens
    return served, exact, radius.masked_fill(~visible, 0.0), visible


def _box_after(served, exact, radius, visible, k):
    """The box of each read with its ``k`` first tokens (the script's ranking) served exact."""
    p = torch.softmax(served.masked_fill(~visible, float("-inf")), -1)
    order = (p * torch.expm1(radius)).masked_fill(~visible, -1.0).amax(0).argsort(-1, descending=True)
    out = []
    for i, n in enumerate(k.tolist()):
        rep = torch.zeros(served.shape[-1], dtype=torch.bool)
        rep[order[i, :n]] = True
        rep &= visible[0, i]
        logits = torch.where(rep, exact[:, i], served[:, i]).masked_fill(~visible[:, i], float("-inf"))
        out.append(tv_box(torch.softmax(logits, -1), radius[:, i].masked_fill(rep, 0.0)).amax())
    return torch.stack(out)


def test_the_count_returned_passes_the_gate_and_never_exceeds_the_visible_tokens():
    for seed in range(12):
        served, exact, radius, visible = _read(seed, scale=0.5 + seed / 3)
        need = trp.tokens_to_pass(served, exact, radius, visible)
        assert bool((need <= visible[0].sum(-1)).all()) and bool((need >= 0).all())
        assert bool((_box_after(served, exact, radius, visible, need) <= trp.TAU + 1e-12).all())


def test_a_read_within_tau_needs_nothing_and_one_bad_token_needs_one():
    served, exact, radius, visible = _read(0, scale=1e-4)
    assert trp.tokens_to_pass(served, exact, radius, visible).tolist() == [0, 0]
    radius = torch.zeros_like(radius)
    top = exact[0, 0].argmax()
    radius[:, :, top] = 5.0  # the token the attention sits on, with a radius the box cannot pass
    exact[:, :, top] += 6.0
    served = exact.clone()
    assert trp.tokens_to_pass(served, exact, radius, visible).tolist() == [1, 1]


def test_light_weights_are_the_light_mass_and_its_heaviest_share():
    served = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=F64))
    light = torch.tensor([False, True, True, True])
    mass, peak = trp.light_weights(served, light)
    assert torch.allclose(mass, torch.tensor([0.5], dtype=F64)) and torch.allclose(peak, torch.tensor([0.6], dtype=F64))
    mass, peak = trp.light_weights(served, torch.zeros(4, dtype=torch.bool))
    assert float(mass) == 0.0 and float(peak) == 0.0  # no light token


def _tiers(seed: int, g: int = 3, nq: int = 4, s: int = 48, light: float = 1.5, heavy: float = 0.01):
    """Logits and radii of every token served light and served heavy (each within its radius of the exact logit),
    causal visibility over the last ``nq`` positions, and a heavy tier of the first 4 tokens."""
    gen = torch.Generator().manual_seed(seed)
    exact = torch.randn(g, nq, s, generator=gen, dtype=F64) * 2
    rad = tuple(torch.rand(g, nq, s, generator=gen, dtype=F64) * w for w in (light, heavy))
    served = tuple(exact + (torch.rand(g, nq, s, generator=gen, dtype=F64) * 2 - 1) * r for r in rad)
    pos, t = torch.arange(s - nq, s).view(1, nq, 1), torch.arange(s).view(1, 1, s)
    visible = (t <= pos).expand(g, nq, s)
    heavy_tier = torch.zeros(s, dtype=torch.bool)
    heavy_tier[:4] = True
    return served, rad, visible, heavy_tier


def _box_with(served, rad, visible, tier, i):
    """The largest box over the query heads of read ``i`` with ``tier`` served heavy."""
    logits = torch.where(tier, served[1][:, i], served[0][:, i])
    p = torch.softmax(logits.masked_fill(~visible[:, i], float("-inf")), -1)
    return float(tv_box(p, torch.where(tier, rad[1][:, i], rad[0][:, i]).masked_fill(~visible[:, i], 0.0)).amax())


def test_promotion_passes_each_read_with_the_least_count_of_its_ranking_and_only_adds_visible_light_tokens():
    counts = []
    for seed in range(8):
        served, rad, visible, heavy = _tiers(seed, light=0.5 + seed / 2)
        nq = visible.shape[1]
        tier_before = heavy
        for i in range(nq):  # the reads' prefixes replay the tiers each read starts from
            cut = (tuple(x[:, : i + 1] for x in served), tuple(x[:, : i + 1] for x in rad), visible[:, : i + 1])
            tier, promoted, failed = trp.promote_reads(*cut, heavy)
            counts.append(int(promoted[i]))
            assert bool((tier >= tier_before).all()), "a promotion never demotes a token"
            new = tier & ~tier_before
            assert int(new.sum()) == int(promoted[i]) and not bool((new & ~visible[0, i]).any())
            assert not bool(failed.any())  # heavy radii of 0.01 pass every read
            assert _box_with(served, rad, visible, tier, i) <= trp.TAU
            if promoted[i] > 0:  # one token fewer on the same ranking fails the read
                p = torch.softmax(
                    torch.where(tier_before, served[1][:, i], served[0][:, i]).masked_fill(~visible[:, i], -torch.inf),
                    -1,
                )
                r = torch.where(tier_before, rad[1][:, i], rad[0][:, i]).masked_fill(~visible[:, i], 0.0)
                movable = visible[0, i] & ~tier_before
                order = (p * torch.expm1(r)).masked_fill(~movable, -1.0).amax(0).argsort(descending=True)
                fewer = tier_before.clone().index_fill_(0, order[: int(promoted[i]) - 1], True)
                assert torch.equal(tier_before.clone().index_fill_(0, order[: int(promoted[i])], True), tier)
                assert _box_with(served, rad, visible, fewer, i) > trp.TAU
            else:
                assert _box_with(served, rad, visible, tier_before, i) <= trp.TAU
            tier_before = tier
    assert 0 in counts and max(counts) > 2, counts  # reads that pass as they are, and reads that promote several


def test_a_read_no_promotion_passes_is_flagged_and_takes_every_visible_token():
    served, rad, visible, heavy = _tiers(3, light=6.0, heavy=6.0)  # the heavy tier is no better than the light
    tier, promoted, failed = trp.promote_reads(served, rad, visible, heavy)
    assert bool(failed.all())
    assert bool(tier[visible[0, -1]].all()) and int(promoted.sum()) == int((visible[0, -1] & ~heavy).sum())
