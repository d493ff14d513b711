"""The autoscaler's decision: how many replicas a model should have, from its load over time.

Pure (no asyncio, no Ray, no clock of its own): the supervisor samples the load every
``autoscaling.interval_s`` and calls ``Autoscaler.observe(now, load)``; unit tests drive it with
a fake clock.

Load: requests in flight plus queued for the model, from every gateway process. It is compared
with ``target_in_flight_per_replica`` x ``desired`` (the replicas asked for, pending ones
included), not x the healthy ones: a replica that waits for a node would otherwise make the
load look high for ever and pile up more pending replicas up to the maximum.

- Up: the load stays above the target for the whole ``scale_up_window_s`` -> desired becomes
  ceil(load / target) at once (capped at ``max_replicas``); the window starts again.
- Down: the load stays within what one replica fewer carries at the target for the whole
  ``scale_down_window_s`` -> one replica fewer (never below ``min_replicas``); each further step
  waits a whole window again, so a lull does not drop several replicas at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem_core.config import AutoscalingConfig


@dataclass(frozen=True)
class Decision:
    """A change of the desired replica count (``observe`` returns None for no change)."""

    desired: int
    previous: int
    load: float

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.previous else "down"


class Autoscaler:
    def __init__(self, config: AutoscalingConfig, initial: int):
        self.config = config
        self.desired = max(config.min_replicas, min(config.max_replicas, initial))
        self._above_since: float | None = None  # since when the load has been above the target
        self._below_since: float | None = None  # since when it has fit in one replica fewer

    def observe(self, now: float, load: float) -> Decision | None:
        """One sample of the load at time ``now`` (seconds, any monotonic origin)."""
        c = self.config
        target = c.target_in_flight_per_replica
        if load > target * self.desired and self.desired < c.max_replicas:
            self._below_since = None
            if self._above_since is None:
                self._above_since = now
            if now - self._above_since >= c.scale_up_window_s:
                return self._set(min(c.max_replicas, math.ceil(load / target)), load)
            return None
        self._above_since = None
        if load <= target * (self.desired - 1) and self.desired > c.min_replicas:
            if self._below_since is None:
                self._below_since = now
            if now - self._below_since >= c.scale_down_window_s:
                return self._set(self.desired - 1, load)
            return None
        self._below_since = None
        return None

    def _set(self, desired: int, load: float) -> Decision:
        previous, self.desired = self.desired, desired
        self._above_since = self._below_since = None  # the next step needs a whole window again
        return Decision(desired, previous, load)
