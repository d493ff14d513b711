"""Batch API helpers shared by the unit and integration tests (official `openai` SDK as client):
a JSONL body, a batch submitted, waited for until it ends, its output and error lines read."""

from __future__ import annotations

import json

import openai

from tests.waiting import wait_for

FINAL = ("completed", "failed", "expired", "cancelled")


def jsonl(items) -> bytes:
    """One line per item: a string as it is (a malformed line), anything else as JSON."""
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in items).encode()


def chat_lines(n: int, model: str, **body) -> list[dict]:
    """``n`` chat lines ``c0``..: "Count to i." to ``model`` (``body``: more request fields)."""
    return [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "messages": [{"role": "user", "content": f"Count to {i}."}], **body}}
            for i in range(n)]


def submit(client: openai.OpenAI, lines, endpoint: str = "/v1/chat/completions", window: str = "24h") -> str:
    """Upload ``lines`` and create a batch of them; its id."""
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window=window).id


def finished(client: openai.OpenAI, batch_id: str, timeout: float = 60, interval: float = 0.1):
    """The batch once it has ended (any final status)."""
    seen = {}

    def ended() -> bool:
        seen["b"] = client.batches.retrieve(batch_id)
        return seen["b"].status in FINAL

    wait_for(ended, f"batch {batch_id} to finish", timeout=timeout, interval=interval)
    return seen["b"]


def completed(client: openai.OpenAI, batch_id: str, lines: int, timeout: float = 900):
    """The batch once ``completed`` (failing at once on another final status), with ``lines``
    answered and none failed, its output holding every custom_id exactly once."""
    b = finished(client, batch_id, timeout=timeout, interval=0.5)
    assert b.status == "completed", b
    assert b.request_counts.completed == lines and b.request_counts.failed == 0, b
    ids = [o["custom_id"] for o in lines_of(client, b.output_file_id)]
    assert len(ids) == len(set(ids)) == lines, ids
    return b


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    """An output or error file's lines (none for no file)."""
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def answered(client: openai.OpenAI, batch_id: str, at_least: int, timeout: float = 300) -> int:
    """Waits until ``at_least`` lines of the batch are answered; how many then."""
    seen = {}

    def enough() -> bool:
        seen["n"] = client.batches.retrieve(batch_id).request_counts.completed
        return seen["n"] >= at_least

    wait_for(enough, f"{at_least} lines of batch {batch_id} answered", timeout=timeout, interval=0.2)
    return seen["n"]
