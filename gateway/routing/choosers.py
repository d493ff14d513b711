"""How a pool picks a replica for one request among the healthy ones with a free slot: each
policy alone, composed by ``router.ModelPool`` (prefix match first, then session affinity, then
power of two choices).

- ``p2c``: two candidates drawn at random, the less loaded one wins (load: ``load +
  others_load``, measured against ``capacity``).
- ``Affinity``: rendezvous hashing of a session key with bounded load: the key's first replica in
  its own order within ``load_factor`` x the average load (counting this request).
- ``PrefixChooser``: an approximate index per replica engine of the prompts sent there
  (``gateway/request/prefix.py``), keyed by (replica id, ``generation``): the replica holding the longest
  run of the prompt's leading blocks within the load bound; on a tie, the matched prefix's own
  first choice (rendezvous on its last block), so a prefix that spilled onto a second replica
  comes back to the first. A request weighs its uncached tokens where its prefix is cached.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence

from gateway.request.prefix import BLOCK_CHARS
from gateway.routing.prefix_index import DEFAULT_INDEX_BLOCKS, PrefixIndex
from gateway.routing.replicas import Replica

# Tokens a prefix block stands for (the gateway's estimate of 4 characters a token).
TOKENS_PER_BLOCK = BLOCK_CHARS // 4


def load_of(r: Replica) -> float:
    """What is in flight on ``r``: from this gateway process and from the others."""
    return r.load + r.others_load


def bound(load_factor: float, healthy: list[Replica], cost: float) -> float:
    """The bounded-load ceiling: ``load_factor`` x the average load, counting a request of
    ``cost``. The least loaded healthy replica is always within it."""
    return load_factor * (sum(load_of(r) for r in healthy) + cost) / len(healthy)


def score(r: Replica) -> tuple[float, int]:
    # AR: capacity is 1, so this orders by tokens in flight; diffusion: by free batch rows.
    return (load_of(r) - r.capacity, r.outstanding)


def rendezvous(key: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{replica_id}".encode(), digest_size=8).digest(), "big")


def p2c(candidates: list[Replica], rng: random.Random) -> Replica:
    """Power of two choices (one candidate: that one)."""
    if len(candidates) == 1:
        return candidates[0]
    a, b = rng.sample(candidates, 2)
    return min(a, b, key=score)


class Affinity:
    def __init__(self, load_factor: float):
        self.load_factor = load_factor

    def choose(self, candidates: list[Replica], healthy: list[Replica], cost: float, key: str) -> Replica:
        ceiling = bound(self.load_factor, healthy, cost)
        ordered = sorted(candidates, key=lambda r: rendezvous(key, r.id), reverse=True)
        return next((r for r in ordered if load_of(r) <= ceiling), min(candidates, key=score))


class PrefixChooser:
    def __init__(self, load_factor: float, index_blocks: int | None = None):
        self.load_factor = load_factor
        # Blocks each replica's index holds; None: the engine's KV capacity (``kv_cache_tokens``
        # in its info) in blocks, else ``DEFAULT_INDEX_BLOCKS``.
        self.index_blocks = index_blocks
        self._indexes: dict[tuple[str, int], PrefixIndex] = {}  # (replica id, generation) -> its index

    def choose(self, candidates: list[Replica], healthy: list[Replica], cost: float,
               prefix: Sequence[int]) -> Replica | None:
        """Among the candidates within the load bound, the one whose index holds the most leading
        blocks of ``prefix``; on a tie, the matched prefix's first in its rendezvous order. None
        when none holds any."""
        ceiling = bound(self.load_factor, healthy, cost)
        best, best_blocks, best_rank = None, 0, 0
        for r in candidates:
            if load_of(r) > ceiling:
                continue
            n = self.index(r).match(prefix)
            if n == 0 or n < best_blocks:
                continue
            rank = hash((prefix[n - 1], r.id))  # per process, like the block hashes
            if n > best_blocks or rank > best_rank:
                best, best_blocks, best_rank = r, n, rank
        return best

    def take(self, replica: Replica, cost: float, prefix: Sequence[int]) -> float:
        """``prefix`` is sent to ``replica``: it is in its index from now on. Returns the request's
        weight there: its cached part is neither computed again nor held twice (requests share
        its KV blocks), so it weighs its uncached tokens and its output."""
        index = self.index(replica)
        cost = max(1.0, cost - index.match(prefix) * TOKENS_PER_BLOCK)
        index.insert(prefix)
        return cost

    def index(self, r: Replica) -> PrefixIndex:
        """The prefix index of ``r``'s current engine (``generation``), sized by its KV capacity."""
        index = self._indexes.get((r.id, r.generation))
        if index is not None:
            return index
        if self.index_blocks is not None:
            size = self.index_blocks
        else:
            kv_tokens = r.info.extra.get("kv_cache_tokens") if r.info is not None else None
            size = (max(1, int(kv_tokens) // TOKENS_PER_BLOCK) if isinstance(kv_tokens, int | float) and kv_tokens > 0
                    else DEFAULT_INDEX_BLOCKS)
        self.drop(r.id)  # an older generation's, if it was not dropped yet
        index = self._indexes[(r.id, r.generation)] = PrefixIndex(size)
        return index

    def existing(self, r: Replica) -> PrefixIndex | None:
        return self._indexes.get((r.id, r.generation))

    def drop(self, replica_id: str) -> None:
        """Forget what any engine of ``replica_id`` held."""
        for key in [k for k in self._indexes if k[0] == replica_id]:
            del self._indexes[key]


class AdapterAffinity:
    """Which LoRA adapters each replica's engine holds in its adapter slots, as the gateway
    routed them: an LRU of ``slots`` (vLLM's ``max_loras``) per replica engine, keyed by (replica
    id, ``generation``). A request for an adapter goes to the least loaded replica holding it,
    within the load bound; none: the caller's next policy (the adapter is loaded there: counted
    in ``loads``)."""

    def __init__(self, slots: int, load_factor: float = 1.25):
        self.slots = max(1, slots)
        self.load_factor = load_factor
        self._held: dict[tuple[str, int], OrderedDict[str, None]] = {}
        self.loads = 0  # requests sent where their adapter was not held (the engine loads it first)

    def choose(self, candidates: list[Replica], healthy: list[Replica], cost: float, adapter: str) -> Replica | None:
        ceiling = bound(self.load_factor, healthy, cost)
        holding = [r for r in candidates if adapter in self._held.get((r.id, r.generation), ()) and
                   load_of(r) <= ceiling]
        return min(holding, key=score) if holding else None

    def take(self, replica: Replica, adapter: str) -> None:
        held = self._held.setdefault((replica.id, replica.generation), OrderedDict())
        if adapter in held:
            held.move_to_end(adapter)
            return
        self.loads += 1
        held[adapter] = None
        while len(held) > self.slots:
            held.popitem(last=False)

    def drop(self, replica_id: str) -> None:
        for key in [k for k in self._held if k[0] == replica_id]:
            del self._held[key]
