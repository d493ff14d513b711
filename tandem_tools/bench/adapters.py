"""`python -m tandem_tools.bench.adapters`: LoRA adapter routing, adapter-aware against p2c.

The gateway's own router (``gateway.routing.router.ModelPool``) over replicas of one base, driven by a
discrete-event load (no engines, no sleeping: each request holds its slot for a random service
time, ``--concurrency`` at once). Each replica's engine holds ``--max-loras`` adapters, least
recently used evicted (as vLLM's LoRA slots); a request whose adapter its replica does not hold
costs a load. Reported per routing: adapter loads per 100 requests and requests per replica,
over several seeds. With ``p2c`` the same slots are counted, the choice ignoring them.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import statistics

from gateway.routing.choosers import AdapterAffinity
from gateway.routing.replicas import Replica, ReplicaState
from gateway.routing.router import ModelPool


async def run(routing: str, seed: int, replicas: int, adapters: int, max_loras: int, requests: int,
              concurrency: int, base_share: float) -> dict:
    rng = random.Random(seed)
    pool = ModelPool("base", "autoregressive",
                     [Replica(id=f"base/{i}", model="base", handle=None, initial=ReplicaState.HEALTHY)
                      for i in range(replicas)],
                     rng=random.Random(seed + 1), adapter_slots=max_loras)
    slots = pool.adapters if routing == "adapter" else AdapterAffinity(max_loras)  # p2c: counted, not consulted
    names = [f"lora-{i}" for i in range(adapters)]
    clock, in_flight, per_replica = 0.0, [], {r.id: 0 for r in pool.replicas}
    for i in range(requests):
        if len(in_flight) >= concurrency:
            clock, _, slot = heapq.heappop(in_flight)
            pool.release(slot)
        adapter = None if rng.random() < base_share else rng.choice(names)
        cost = float(rng.randint(100, 400))
        slot = await pool.acquire(cost=cost, adapter=adapter if routing == "adapter" else None)
        if adapter is not None and routing != "adapter":
            slots.take(slot.replica, adapter)
        per_replica[slot.replica.id] += 1
        heapq.heappush(in_flight, (clock + rng.expovariate(1.0), i, slot))
    adapter_requests = requests - round(requests * base_share)
    return {"routing": routing, "seed": seed, "loads_per_100": 100 * slots.loads / requests,
            "loads_per_100_adapter_requests": 100 * slots.loads / max(1, adapter_requests),
            "requests_per_replica": sorted(per_replica.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem_tools.bench.adapters", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="replicas of the base (default: 2)")
    p.add_argument("--adapters", type=int, default=4, help="adapters in the traffic, drawn uniformly (default: 4)")
    p.add_argument("--max-loras", type=int, default=2, help="adapters a replica's engine holds (default: 2)")
    p.add_argument("--requests", type=int, default=2000, help="requests per run (default: 2000)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: 8)")
    p.add_argument("--base-share", type=float, default=0.2, help="share of requests for the base (default: 0.2)")
    p.add_argument("--seeds", type=int, default=5, help="runs per routing (default: 5)")
    args = p.parse_args(argv)
    rows = [asyncio.run(run(routing, seed, args.replicas, args.adapters, args.max_loras, args.requests,
                            args.concurrency, args.base_share))
            for seed in range(args.seeds) for routing in ("p2c", "adapter")]
    for row in rows:
        print(json.dumps(row))
    summary = {}
    for routing in ("p2c", "adapter"):
        mine = [r for r in rows if r["routing"] == routing]
        summary[routing] = {"loads_per_100": round(statistics.median(r["loads_per_100"] for r in mine), 1),
                            "busiest_replica_share": round(statistics.median(
                                max(r["requests_per_replica"]) / args.requests for r in mine), 3)}
    summary["adapter/p2c loads"] = round(summary["adapter"]["loads_per_100"] / summary["p2c"]["loads_per_100"], 3)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
