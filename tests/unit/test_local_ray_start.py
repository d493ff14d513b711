"""workers.deployment starts a local Ray once more when Ray's fixed raylet wait runs out, and
only then (any other failure is raised at once)."""

import pytest
import ray

from workers import deployment


def _fake_init(monkeypatch, errors):
    calls = {"init": 0, "shutdown": 0}

    def init(**kwargs):
        calls["init"] += 1
        if errors:
            raise errors.pop(0)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1))
    return calls


def test_a_raylet_start_timeout_is_retried_once(monkeypatch):
    calls = _fake_init(monkeypatch, [Exception("The current node timed out during startup. This could happen")])
    deployment._start_local_ray(2)
    assert calls == {"init": 2, "shutdown": 1}


def test_a_second_timeout_is_raised(monkeypatch):
    err = Exception("The current node timed out during startup.")
    calls = _fake_init(monkeypatch, [err, err])
    with pytest.raises(Exception, match="timed out during startup"):
        deployment._start_local_ray(2)
    assert calls["init"] == 2


def test_other_failures_are_not_retried(monkeypatch):
    calls = _fake_init(monkeypatch, [ValueError("num_cpus must not be provided")])
    with pytest.raises(ValueError):
        deployment._start_local_ray(2)
    assert calls["init"] == 1
