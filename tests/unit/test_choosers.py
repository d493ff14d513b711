"""Each replica choice policy alone (``gateway/routing/choosers.py``), without a pool."""

import random

from gateway.routing.choosers import TOKENS_PER_BLOCK, Affinity, PrefixChooser, p2c
from gateway.routing.replicas import Replica, ReplicaState


def _replicas(*loads):
    return [Replica(id=f"m/{i}", model="m", handle=None, initial=ReplicaState.HEALTHY, load=x, outstanding=int(x > 0))
            for i, x in enumerate(loads)]


def test_p2c_takes_the_less_loaded_of_two():
    a, b = _replicas(0, 100)
    assert all(p2c([a, b], random.Random(seed)) is a for seed in range(20))
    assert p2c([b], random.Random(0)) is b


def test_affinity_keeps_a_key_on_its_replica_until_it_is_over_the_bound():
    rs = _replicas(0, 0, 0)
    aff = Affinity(1.25)
    home = aff.choose(rs, rs, 1.0, "session-7")
    assert all(aff.choose(rs, rs, 1.0, "session-7") is home for _ in range(5))
    home.load = 1000.0  # far over 1.25 x the average: the key moves
    moved = aff.choose(rs, rs, 1.0, "session-7")
    assert moved is not home and moved.load == 0


def test_prefix_picks_the_longest_match_weighs_the_uncached_part_and_drops_a_gone_engine():
    rs = _replicas(0, 0)
    ch = PrefixChooser(1.25, index_blocks=100)
    assert ch.choose(rs, rs, 10, (1, 2, 3)) is None  # nothing indexed yet
    assert ch.take(rs[0], 10 * TOKENS_PER_BLOCK, (1, 2, 3)) == 10 * TOKENS_PER_BLOCK  # a miss weighs it all
    ch.take(rs[1], 10, (1, 9))
    assert ch.choose(rs, rs, 10, (1, 2, 3, 4)) is rs[0]
    assert ch.take(rs[0], 10 * TOKENS_PER_BLOCK, (1, 2, 3, 4)) == 7 * TOKENS_PER_BLOCK  # 3 blocks cached
    rs[0].move_to(ReplicaState.RESTARTING, "died")  # a new generation: its old index is not read
    ch.drop(rs[0].id)
    assert ch.existing(rs[0]) is None and ch.choose(rs, rs, 10, (1, 2, 3)) is rs[1]  # (1,) matched there
