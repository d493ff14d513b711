"""The Files and Batch API on fake engines (issue 34), with the official `openai` SDK as client:
the round trip, bad lines and bad files, cancel, expiry, and the store's recovery from every
state a dead process may leave a batch in (``gateway/batches/store.py``)."""

from __future__ import annotations

import json
import time

import openai
import pytest
from openai.types.chat import ChatCompletion

from gateway.batches.store import BatchStore, Line
from tests.batches import finished, jsonl, lines_of
from tests.unit.gateway_server import fake_gateway
from tests.waiting import wait_for


def _gateway(tmp_path, engine: dict | None = None, **batches):
    cfg = {"data_dir": str(tmp_path / "data"), "poll_s": 0.1, "lease_s": 1, **batches}
    return fake_gateway(engine or {"num_tokens": 3}, extra={"batches": cfg})


def _line(i: int, url: str = "/v1/chat/completions", **body) -> dict:
    if url == "/v1/completions":
        payload = {"model": "fake", "prompt": f"p{i}", **body}
    else:
        payload = {"model": "fake", "messages": [{"role": "user", "content": f"hi {i}"}], **body}
    return {"custom_id": f"c{i}", "method": "POST", "url": url, "body": payload}


def test_a_batch_runs_through_the_sdk_with_bad_lines_in_the_error_file(tmp_path):
    with _gateway(tmp_path) as (url, _, deployment):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        good = [_line(i) for i in range(12)]
        bad = ["not json", json.dumps({"custom_id": "wrong-url", **{k: v for k, v in _line(99).items() if k != "custom_id"},
                                       "url": "/v1/completions"}),
               json.dumps({**_line(98), "custom_id": "no-model", "body": {"model": "nope", "messages": []}}),
               json.dumps({**_line(97), "custom_id": "streams", "body": {**_line(97)["body"], "stream": True}}),
               json.dumps(_line(0))]  # a duplicate custom_id
        f = client.files.create(file=("in.jsonl", jsonl([*good, *bad])), purpose="batch")
        assert f.purpose == "batch" and f.bytes > 0 and client.files.retrieve(f.id).id == f.id
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                      metadata={"job": "t1"})
        assert batch.status == "validating" and batch.metadata == {"job": "t1"}
        batch = finished(client, batch.id)
        assert batch.status == "completed", batch
        assert batch.request_counts.total == 17 and batch.request_counts.completed == 12
        assert batch.request_counts.failed == 5
        assert all(getattr(batch, f"{s}_at") for s in ("in_progress", "finalizing", "completed"))
        output, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
        assert sorted(o["custom_id"] for o in output) == sorted(g["custom_id"] for g in good)
        for o in output:
            assert o["response"]["status_code"] == 200 and o["error"] is None
            ChatCompletion.model_validate(o["response"]["body"])
        assert [e["custom_id"] for e in errors] == [None, "wrong-url", "no-model", "streams", "c0"]
        assert [e["error"]["code"] for e in errors] == ["invalid_json_line", "invalid_url", "model_not_found",
                                                       "invalid_request", "duplicate_custom_id"]
        completion_tokens = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in output)
        assert batch.usage.output_tokens == completion_tokens and batch.usage.total_tokens > completion_tokens
        # The lines ran at the batch class's priority, below every online request.
        (engine,) = deployment.engines.values()
        assert engine.priorities == [1000] * 12
        assert client.batches.list().data[0].id == batch.id
        assert {x.id for x in client.files.list().data} >= {f.id, batch.output_file_id, batch.error_file_id}
        with pytest.raises(openai.BadRequestError):  # finished: nothing to cancel
            client.batches.cancel(batch.id)
        assert client.files.delete(f.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(f.id)


def test_completions_lines_and_bad_requests_answered_by_the_engine(tmp_path):
    with _gateway(tmp_path) as (url, _, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        lines = [_line(i, "/v1/completions") for i in range(3)] + [_line(3, "/v1/completions", max_tokens=-1)]
        f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = finished(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                        completion_window="24h").id)
        assert batch.status == "completed" and batch.request_counts.completed == 3
        (err,) = lines_of(client, batch.error_file_id)
        assert err["custom_id"] == "c3" and err["response"]["status_code"] == 400
        assert err["response"]["body"]["error"]["param"] == "max_tokens"


def test_bad_files_and_bad_batches(tmp_path):
    with _gateway(tmp_path, max_lines=3) as (url, _, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def run(data: bytes):
            f = client.files.create(file=("in.jsonl", data), purpose="batch")
            return finished(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                           completion_window="24h").id)

        for data, code in ((b"", "empty_file"), (b"\xff\xfe\x00", "invalid_file"),
                           (jsonl([_line(i) for i in range(4)]), "too_many_lines")):
            b = run(data)
            assert b.status == "failed" and b.failed_at and b.errors.data[0].code == code, b
        f = client.files.create(file=("in.jsonl", jsonl([_line(0)])), purpose="batch")
        for kw, param in (({"endpoint": "/v1/nope"}, "endpoint"), ({"completion_window": "soon"}, "completion_window"),
                          ({"input_file_id": "file-missing"}, "file_id")):
            args = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **kw}
            with pytest.raises(openai.APIStatusError) as e:
                client.batches.create(**args)
            assert e.value.status_code in (400, 404) and e.value.body["param"] == param, e.value.body
        with pytest.raises(openai.BadRequestError) as e:
            client.files.create(file=("x.jsonl", b"{}"), purpose="nonsense")
        assert e.value.body["param"] == "purpose"


def test_cancel_ends_cancelled_with_the_finished_lines(tmp_path):
    with _gateway(tmp_path, {"num_tokens": 10, "token_delay_s": 0.05}, lines_in_flight=2) as (url, _, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        f = client.files.create(file=("in.jsonl", jsonl([_line(i) for i in range(40)])), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, "two lines done")
        t0 = time.monotonic()
        assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        batch = finished(client, batch.id, timeout=10)
        assert batch.status == "cancelled" and batch.cancelling_at and batch.cancelled_at
        assert time.monotonic() - t0 < 5
        done = batch.request_counts.completed
        assert 2 <= done < 40 and len(lines_of(client, batch.output_file_id)) == done
        assert client.batches.cancel(batch.id).status == "cancelled"  # again: answered as it is


def test_a_batch_past_its_window_expires_keeping_its_finished_lines(tmp_path):
    with _gateway(tmp_path, {"num_tokens": 10, "token_delay_s": 0.05}, lines_in_flight=1) as (url, _, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        f = client.files.create(file=("in.jsonl", jsonl([_line(i) for i in range(30)])), purpose="batch")
        batch = finished(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                        completion_window="2s").id, timeout=20)
        assert batch.status == "expired" and batch.expired_at
        output, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
        assert 1 <= len(output) < 30 and {e["error"]["code"] for e in errors} == {"batch_expired"}
        assert sorted(x["custom_id"] for x in output + errors) == sorted(f"c{i}" for i in range(30))


@pytest.mark.parametrize("state", ["validating", "in_progress", "finalizing", "cancelling"])
def test_a_batch_left_in_any_state_by_a_dead_process_is_taken_over(tmp_path, state):
    """A process died holding the batch (its lease set, never renewed): the next one takes it when
    the lease lapses and ends it; a line answered before the crash is neither redone nor doubled."""
    store = BatchStore(tmp_path / "data")
    lines = [_line(i) for i in range(6)]
    f = store.add_file(jsonl(lines), "batch", "in.jsonl", None)
    b = store.add_batch(endpoint="/v1/chat/completions", input_file_id=f["id"], completion_window="24h",
                        window_s=86400, metadata=None, output_expires_s=None, tenant=None, key=None)
    assert list(store.claim("dead-process", lease_s=0.5)) == [b["id"]]
    if state != "validating":
        store.add_lines(b["id"], [Line(i, f"c{i}", {"custom_id": f"c{i}", "body": ln["body"]})
                                  for i, ln in enumerate(lines)], "fake")
        store.answer(b["id"], 0, {"custom_id": "c0", "response": {"status_code": 200, "body": {"before": True}},
                                  "error": None}, ok=True)
        if state in ("finalizing", "cancelling"):
            for i in range(1, 6 if state == "finalizing" else 3):
                store.answer(b["id"], i, {"custom_id": f"c{i}", "response": {"status_code": 200, "body": {}},
                                          "error": None}, ok=True)
        store.move(b["id"], "in_progress")
        if state != "in_progress":
            store.move(b["id"], state)
    store.close()
    with _gateway(tmp_path) as (url, _, deployment):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        batch = finished(client, b["id"])
        assert batch.status == ("cancelled" if state == "cancelling" else "completed"), batch
        output = lines_of(client, batch.output_file_id)
        ids = [o["custom_id"] for o in output]
        assert len(ids) == len(set(ids))
        ran = len(next(iter(deployment.engines.values())).priorities)
        if state == "validating":
            assert sorted(ids) == sorted(f"c{i}" for i in range(6)) and ran == 6
        elif state == "in_progress":
            assert sorted(ids) == sorted(f"c{i}" for i in range(6)) and ran == 5  # c0 not redone
            assert output[0]["response"]["body"] == {"before": True}
        elif state == "finalizing":
            assert len(ids) == 6 and ran == 0
        else:
            assert sorted(ids) == ["c0", "c1", "c2"] and ran == 0


def test_two_processes_one_runner_per_batch(tmp_path):
    a, b = BatchStore(tmp_path), BatchStore(tmp_path)
    f = a.add_file(b"{}\n", "batch", "in.jsonl", None)
    batch = a.add_batch(endpoint="/v1/chat/completions", input_file_id=f["id"], completion_window="24h",
                        window_s=86400, metadata=None, output_expires_s=None, tenant=None, key=None)
    assert a.claim("a", 10) == {batch["id"]: 1}
    assert b.claim("b", 10) == {}  # held
    assert a.claim("a", 10) == {batch["id"]: 1}  # renewed (the same epoch)
    assert b.claim("b", 10, now=time.time() + 11) == {batch["id"]: 2}  # lapsed: taken over, a new epoch
    assert a.claim("a", 10) == {}
    b.release("b")
    assert a.claim("a", 10) == {batch["id"]: 3}  # released on a clean stop: taken at once


def test_run_batch_against_a_running_tandem_mixes_endpoints_in_input_order(tmp_path):
    from tandem_tools import cli

    with _gateway(tmp_path) as (url, _, _):
        lines = [_line(0), _line(1, "/v1/completions"), "not json", _line(2), _line(3, "/v1/completions")]
        src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        src.write_bytes(jsonl(lines))
        assert cli.main(["run-batch", "-i", str(src), "-o", str(out), "--url", url]) == 0
        answers = [json.loads(x) for x in out.read_text().splitlines()]
        assert [a["custom_id"] for a in answers] == ["c0", "c1", None, "c2", "c3"]
        assert answers[0]["response"]["body"]["object"] == "chat.completion"
        assert answers[1]["response"]["body"]["object"] == "text_completion"
        assert answers[2]["error"]["code"] == "invalid_json_line"
    assert cli.main(["run-batch", "-i", str(src), "-o", str(out)]) == 2  # neither a server nor a model


def test_uploads_have_their_own_body_limit_and_expired_files_go(tmp_path):
    import httpx

    extra = {"batches": {"data_dir": str(tmp_path / "data"), "poll_s": 0.1, "max_file_bytes": 4096},
             "limits": {"max_body_bytes": 1024}}
    with fake_gateway({"num_tokens": 3}, extra=extra) as (url, _, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert client.files.create(file=("in.jsonl", b"x" * 3000), purpose="batch").bytes == 3000  # over 1 KiB
        with pytest.raises(openai.APIStatusError) as e:
            client.files.create(file=("in.jsonl", b"x" * 5000), purpose="batch")
        assert e.value.status_code == 413
        big = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x" * 2000}, timeout=30)
        assert big.status_code == 413  # the other routes keep limits.max_body_bytes
        store = BatchStore(tmp_path / "data")
        gone = store.add_file(b"{}\n", "batch_output", "old.jsonl", None, expires_at=int(time.time()) - 1)
        store.close()
        wait_for(lambda: client.files.list().data and gone["id"] not in [x.id for x in client.files.list().data],
                 "the expired file to be deleted", timeout=10)
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(gone["id"])


def test_a_key_not_more_urgent_than_batch_lines_fails_at_start_in_one_line():
    from gateway.config import parse_config

    with pytest.raises(Exception) as e:
        parse_config({"auth": {"api_keys": [{"key": "sk-late-0123456789abcdef", "name": "late", "priority": 1000}]},
                      "models": [{"name": "fake", "kind": "autoregressive", "source": "none"}]})
    message = str(e.value)
    assert "auth.api_keys.0.priority" in message and "batches.priority" in message and "\n" not in message.strip()
