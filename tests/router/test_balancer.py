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


def test_close_loads_without_affinity_go_to_the_least_loaded():
    """Within the slack and with no remembered prefix, the lesser load still wins (then the lower index)."""
    b = Balancer(16, min_slack_tokens=256)
    assert b.pick([Candidate(0, 200), Candidate(1, 150), Candidate(2, 180)], [1, 2, 3]) == 1
    assert b.pick([Candidate(2, 50), Candidate(0, 50)], [1, 2, 3]) == 0


def test_the_slack_grows_with_the_least_load():
    """Affinity holds within `slack` of the least load once that exceeds min_slack_tokens: 25 % over a least
    load of 10 000 keeps the prefix's replica, 30 % does not."""
    b = Balancer(16, slack=0.25, min_slack_tokens=256)
    prompt = list(range(48))
    assert b.pick([Candidate(0, 0), Candidate(1, 10)], prompt) == 0
    assert b.pick([Candidate(0, 12_500), Candidate(1, 10_000)], prompt) == 0
    assert b.pick([Candidate(0, 13_000), Candidate(1, 10_000)], prompt) == 1


def test_affinity_follows_the_longest_shared_prefix():
    """Hashes chain block by block: a prompt that differs in its first block shares nothing, and the replica
    that holds more of the prefix wins over one that holds less."""
    b = Balancer(16)
    base = list(range(64))
    assert b.pick([Candidate(0, 0)], base[:16]) == 0              # replica 0: block 0 only
    assert b.pick([Candidate(1, 0)], base) == 1                   # replica 1: blocks 0-3
    assert b.pick([Candidate(0, 0), Candidate(1, 0)], base + [5]) == 1
    other = [999] + base[1:]
    assert b.matched_blocks(1, b.prefix_hashes(other)) == 0


def test_affinity_memory_is_bounded():
    """Past `memory` hashes a replica forgets its oldest prefixes first."""
    b = Balancer(16, memory=4)
    first, second = list(range(64)), list(range(100, 164))
    b.pick([Candidate(0, 0)], first)
    b.pick([Candidate(0, 0)], second)
    assert b.matched_blocks(0, b.prefix_hashes(first)) == 0
    assert b.matched_blocks(0, b.prefix_hashes(second)) == 4
