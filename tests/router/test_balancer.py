"""Balancer: least outstanding work first; prefix affinity among replicas whose loads are close."""
from __future__ import annotations

from mii_async.router.balancer import Balancer, Candidate


def test_least_loaded_wins():
    """With no shared prefix, the replica with the fewest outstanding tokens takes the request."""
    b = Balancer(16)
    assert b.pick([Candidate(0, 5000), Candidate(1, 100), Candidate(2, 900)], list(range(40))) == 1


def test_prefix_affinity_when_loads_are_close():
    """A replica that recently got the same prefix is preferred while its load is within the slack."""
    b = Balancer(16, min_slack_tokens=256)
    prompt = list(range(64))
    assert b.pick([Candidate(0, 0), Candidate(1, 0)], prompt) == 0
    # Replica 0 is now a little busier, but it holds the prefix.
    assert b.pick([Candidate(0, 200), Candidate(1, 0)], prompt + [7, 8, 9]) == 0
    # Far busier: load wins over affinity.
    assert b.pick([Candidate(0, 5000), Candidate(1, 0)], prompt) == 1


def test_short_prompts_and_no_candidates():
    """Prompts shorter than a block carry no affinity; no candidate gives None."""
    b = Balancer(16)
    assert b.prefix_hashes(list(range(15))) == []
    assert b.pick([], [1, 2, 3]) is None
    assert b.pick([Candidate(3, 10), Candidate(1, 10)], [1, 2]) == 1


def test_forget_clears_affinity():
    """A replaced replica's cache is empty: its remembered prefixes are dropped."""
    b = Balancer(16)
    prompt = list(range(32))
    b.pick([Candidate(0, 0)], prompt)
    assert b.matched_blocks(0, b.prefix_hashes(prompt)) == 2
    b.forget(0)
    assert b.matched_blocks(0, b.prefix_hashes(prompt)) == 0
