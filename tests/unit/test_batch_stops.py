"""Nothing lost when a batch's runner stops (issue 50), on fake engines with the official SDK:
a drain (SIGTERM's path) leaves the unfinished lines pending and never finalizes the batch, and the
next process completes it with every line once; a fenced lease (a runner that lost its batch can
store no answer, checked in the store's transaction); a line whose task raises is an error line; a
line whose replica was removed is served again; a batch whose key was removed runs no line keyless."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from gateway.batches import runner as batch_runner
from gateway.batches.store import BatchStore, Line
from tandem_core.errors import ErrorKind, TandemError
from tests.batches import finished, lines_of, submit
from tests.unit.gateway_server import fake_gateway
from tests.waiting import wait_for

# alone under -n (tests/parallel.py): leases of one second
pytestmark = pytest.mark.alone

KEY = "sk-batch-0123456789abcdef"


def _gateway(tmp_path, engine: dict | None = None, extra: dict | None = None, **batches):
    cfg = {"data_dir": str(tmp_path / "data"), "poll_s": 0.1, "lease_s": 1, **batches}
    return fake_gateway(engine or {"num_tokens": 3}, extra={"batches": cfg, **(extra or {})})


def _line(i: int, **body) -> dict:
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "fake", "messages": [{"role": "user", "content": f"hi {i}"}], **body}}


def _submit(client: openai.OpenAI, n: int, **body) -> str:
    return submit(client, [_line(i, **body) for i in range(n)])


def _store_batch(store: BatchStore, n: int) -> str:
    f = store.add_file(b"{}\n", "batch", "in.jsonl", None)
    b = store.add_batch(endpoint="/v1/chat/completions", input_file_id=f["id"], completion_window="24h",
                        window_s=86400, metadata=None, output_expires_s=None, tenant=None, key=None)
    store.add_lines(b["id"], [Line(i, f"c{i}", _line(i)) for i in range(n)], "fake")
    store.move(b["id"], "in_progress")
    return b["id"]


def _answer(i: int) -> dict:
    return {"custom_id": f"c{i}", "response": {"status_code": 200, "body": {}}, "error": None}


def test_a_runner_that_lost_its_lease_can_store_nothing(tmp_path):
    """Compare and set on (owner, epoch) in the answer's transaction: the stalled owner's answer is
    refused once another process took the batch (a new epoch), even for a line still pending."""
    a, b = BatchStore(tmp_path), BatchStore(tmp_path)
    batch = _store_batch(a, 3)
    (epoch_a,) = a.claim("a", 10).values()
    assert a.holds(batch, ("a", epoch_a)) and a.answer(batch, 0, _answer(0), ok=True, fence=("a", epoch_a))
    (epoch_b,) = b.claim("b", 10, now=a.batch(batch)["lease_until"] + 1).values()  # a stalled past its lease
    assert epoch_b == epoch_a + 1
    assert not a.holds(batch, ("a", epoch_a))
    assert not a.answer(batch, 1, _answer(1), ok=True, fence=("a", epoch_a))  # fenced: not stored
    assert not a.move(batch, "finalizing", fence=("a", epoch_a))
    assert b.answer(batch, 1, _answer(1), ok=True, fence=("b", epoch_b))
    assert not b.answer(batch, 1, _answer(1), ok=True, fence=("b", epoch_b))  # one answer per line, ever
    assert a.claim("a", 10) == {}  # a's next poll finds nothing of its own


def test_a_batch_is_finalized_only_when_no_line_is_pending(tmp_path):
    store = BatchStore(tmp_path)
    batch = _store_batch(store, 2)
    assert store.answer(batch, 0, _answer(0), ok=True)
    assert not store.move(batch, "finalizing", answered=True)
    assert store.answer(batch, 1, _answer(1), ok=True)
    assert store.move(batch, "finalizing", answered=True)


def test_a_lease_shorter_than_three_polls_is_a_one_line_config_error():
    from gateway.config import parse_config

    with pytest.raises(Exception) as e:
        parse_config({"batches": {"lease_s": 2, "poll_s": 1}, "models": [
            {"name": "m", "kind": "autoregressive", "source": "none"}]})
    message = str(e.value)
    assert "lease_s" in message and "poll_s" in message and "\n" not in message.strip()


def test_a_drain_leaves_unfinished_lines_pending_and_the_next_process_completes_the_batch(tmp_path):
    """SIGTERM's path (``Service.drain``): the runner starts no new line, the lines in flight
    finish, the batch stays in progress with lines pending (never finalized with lines missing);
    the next process on the same data dir completes it with every custom_id once, none failed."""
    n = 60
    engine = {"num_tokens": 5, "token_delay_s": 0.05}  # 0.25 s a line, 2 at once: ~8 s for the batch
    with _gateway(tmp_path, engine, lines_in_flight=2) as (url, service, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        batch_id = _submit(client, n)
        wait_for(lambda: client.batches.retrieve(batch_id).request_counts.completed >= 8, "8 lines done")
        drained = asyncio.run_coroutine_threadsafe(service.drain(), service.loop).result(timeout=30)
        assert drained
        wait_for(lambda: not service.in_flight(), "the lines in flight to finish")
    store = BatchStore(tmp_path / "data")
    row, counts = store.batch(batch_id), store.counts(batch_id)["request_counts"]
    pending = len(store.pending(batch_id))
    store.close()
    assert row["status"] == "in_progress" and row["owner"] is None  # released for the next process at once
    assert counts["failed"] == 0 and 8 <= counts["completed"] < n and pending == n - counts["completed"]
    with _gateway(tmp_path, engine, lines_in_flight=2) as (url, _, deployment):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        batch = finished(client, batch_id)
        assert batch.status == "completed" and batch.request_counts.completed == n and batch.request_counts.failed == 0
        ids = [o["custom_id"] for o in lines_of(client, batch.output_file_id)]
        assert sorted(ids) == sorted(f"c{i}" for i in range(n))
        (engine_after,) = deployment.engines.values()
        assert len(engine_after.served) == pending  # only what was pending ran again


def test_a_line_whose_task_raises_is_an_error_line_counted_as_failed(tmp_path, monkeypatch):
    real = batch_runner.serve

    async def serve(service, env, internal=False):
        if env.body["messages"][0]["content"] == "hi 3":
            raise RuntimeError("a bug in the line's path")
        return await real(service, env, internal=internal)

    monkeypatch.setattr(batch_runner, "serve", serve)
    with _gateway(tmp_path) as (url, service, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        batch = finished(client, _submit(client, 6))
        assert batch.status == "completed" and batch.request_counts.completed == 5
        assert batch.request_counts.failed == 1
        (err,) = lines_of(client, batch.error_file_id)
        assert err["custom_id"] == "c3" and err["response"]["status_code"] == 500
        request_id = err["response"]["request_id"]
        assert request_id == f"{batch.id}-3" and request_id in err["response"]["body"]["error"]["message"]
        text = httpx.get(url + "/metrics", timeout=10).text
        assert 'tandem_batch_lines_total{outcome="failed"} 1.0' in text


def test_a_line_whose_replica_was_removed_is_served_again(tmp_path, monkeypatch):
    """A scale-down fails a line's request with SHUTTING_DOWN while this process serves on: the
    line is handed back and served again, not left pending nor called done."""
    real = batch_runner.serve
    failed: set[str] = set()

    async def serve(service, env, internal=False):
        rid = env.request_id
        if rid.endswith(("-1", "-4")) and rid not in failed:
            failed.add(rid)
            raise TandemError(ErrorKind.SHUTTING_DOWN, "the replica serving this request was removed (scaled down)")
        return await real(service, env, internal=internal)

    monkeypatch.setattr(batch_runner, "serve", serve)
    with _gateway(tmp_path) as (url, _, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        batch = finished(client, _submit(client, 6))
        assert len(failed) == 2
        assert batch.status == "completed" and batch.request_counts.completed == 6, batch


def test_a_batch_whose_key_was_removed_fails_its_lines_with_401(tmp_path):
    """Created with a key, resumed by a process whose config no longer has it: its pending lines are
    401 error lines; none runs without a key."""
    keys = {"auth": {"api_keys": [{"key": KEY, "name": "batcher", "tenant": "team"}]}}
    with _gateway(tmp_path, {"num_tokens": 3, "hang": True}, extra=keys) as (url, service, deployment):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        batch_id = _submit(client, 3)
        wait_for(lambda: client.batches.retrieve(batch_id).status == "in_progress", "the batch to start")
    other = {"auth": {"api_keys": [{"key": "sk-other-0123456789abcdef", "name": "other", "role": "admin"}]}}
    with _gateway(tmp_path, extra=other) as (url, _, deployment):
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-other-0123456789abcdef", max_retries=0)
        batch = finished(client, batch_id)
        assert batch.request_counts.failed == 3 and batch.request_counts.completed == 0
        assert {e["response"]["status_code"] for e in lines_of(client, batch.error_file_id)} == {401}
        (engine,) = deployment.engines.values()
        assert engine.served == []
