"""Seed policies for the replica tests (importable by the spawned rank processes)."""


def rank_dependent_seed(nonce: int, rank: int) -> int:
    """A deliberate bug: the rank enters the dither seed, so the ranks realise different draws."""
    return nonce + 1000 * rank
