"""`tandem run-batch -i IN.jsonl -o OUT.jsonl (--url URL | MODEL | --config FILE)`: a batch file
of OpenAI request lines, answered into one output file, as `vllm run-batch` does, but through
tandem's own serving path: the lines go to the Batch API of a running tandem (``--url``), or of
one this command starts for MODEL (with `tandem serve MODEL`'s flags) or a config, and stops after.

The input may mix endpoints (each line's ``url``): one batch per endpoint. The output has one line
per input line, in input order: the answer (``response``) or the error (``error``), OpenAI's batch
output shape (which `vllm run-batch` writes too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import httpx

FINAL = ("completed", "failed", "expired", "cancelled")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", metavar="MODEL", help="serve this model for the batch (a local checkpoint "
                   "or a Hugging Face id; any `tandem serve MODEL` flag may follow), then stop it")
    p.add_argument("-i", "--input-file", required=True, metavar="IN", help="the batch: JSONL of {custom_id, "
                   "method, url, body} lines (OpenAI's batch input)")
    p.add_argument("-o", "--output-file", required=True, metavar="OUT", help="where the answers go (JSONL, one "
                   "per input line, in order)")
    p.add_argument("--url", help="a running tandem (http://HOST:PORT) instead of starting one")
    p.add_argument("--config", metavar="FILE", help="start `tandem serve --config FILE` for the batch")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="the key, when the server "
                   "requires one (default: $OPENAI_API_KEY)")
    p.add_argument("--completion-window", default="24h", help="the batches' window (default 24h)")
    p.add_argument("--ready-timeout", type=float, default=900, help="seconds to wait for a started server")


def main(args: argparse.Namespace) -> int:
    lines = Path(args.input_file).read_text().splitlines()
    if (args.url is None) == (args.model is None and args.config is None):
        print("tandem run-batch: give --url (a running tandem), or MODEL or --config (one started for the batch)",
              file=sys.stderr)
        return 2
    with _server(args) as url:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        with httpx.Client(base_url=url, headers=headers, timeout=300) as client:
            answers = run(client, lines, args.completion_window)
    Path(args.output_file).write_text("".join(json.dumps(a) + "\n" for a in answers))
    failed = sum(a.get("error") is not None or (a.get("response") or {}).get("status_code") != 200 for a in answers)
    print(f"tandem run-batch: {len(answers)} lines answered, {failed} with an error -> {args.output_file}")
    return 0


def run(client: httpx.Client, lines: list[str], window: str = "24h", poll_s: float = 1.0) -> list[dict]:
    """Each endpoint's lines as one batch; the answers in input order."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for i, text in enumerate(lines):
        if not text.strip():
            continue
        try:
            url = json.loads(text).get("url")
        except (ValueError, AttributeError):
            url = None
        groups.setdefault(url if isinstance(url, str) else "/v1/chat/completions", []).append((i, text))
    answers: dict[int, dict] = {}
    for endpoint, group in groups.items():
        for (i, _), answer in zip(group, _one_batch(client, endpoint, [t for _, t in group], window, poll_s),
                                  strict=True):
            answers[i] = answer
    return [answers[i] for i in sorted(answers)]


def _one_batch(client: httpx.Client, endpoint: str, lines: list[str], window: str, poll_s: float) -> list[dict]:
    data = "".join(line + "\n" for line in lines).encode()
    f = _ok(client.post("/v1/files", files={"file": ("batch.jsonl", data)}, data={"purpose": "batch"}))
    batch = _ok(client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": endpoint,
                                                 "completion_window": window}))
    while batch["status"] not in FINAL:
        time.sleep(poll_s)
        batch = _ok(client.get(f"/v1/batches/{batch['id']}"))
    if batch["status"] == "failed":
        raise SystemExit(f"tandem run-batch: the {endpoint} batch failed: {batch['errors']}")
    by_line: list[dict | None] = [None] * len(lines)
    answered = []
    for file_id in (batch["output_file_id"], batch["error_file_id"]):
        if file_id:
            answered += [json.loads(x) for x in _content(client, file_id).splitlines()]
    # Answers carry the line's index in their request id (``<batch>-<index>``), or its custom_id.
    ids = {}
    for i, text in enumerate(lines):
        with contextlib.suppress(ValueError, AttributeError):
            ids.setdefault(json.loads(text).get("custom_id"), i)
    for a in answered:
        rid = (a.get("response") or {}).get("request_id") or ""
        index = int(rid.rsplit("-", 1)[1]) if rid.startswith(batch["id"] + "-") else ids.get(a.get("custom_id"))
        if index is not None and by_line[index] is None:
            by_line[index] = a
        else:  # an answer without its own line (a duplicate custom_id): the first free one
            by_line[by_line.index(None)] = a
    return [a if a is not None else {"custom_id": None, "response": None,
                                     "error": {"code": "not_answered", "message": "no answer"}} for a in by_line]


def _ok(r: httpx.Response) -> dict:
    if r.status_code != 200:
        raise SystemExit(f"tandem run-batch: {r.request.method} {r.request.url.path}: {r.status_code} {r.text}")
    return r.json()


def _content(client: httpx.Client, file_id: str) -> str:
    r = client.get(f"/v1/files/{file_id}/content")
    if r.status_code != 200:
        raise SystemExit(f"tandem run-batch: file {file_id}: {r.status_code} {r.text}")
    return r.text


@contextlib.contextmanager
def _server(args: argparse.Namespace):
    """The URL of the tandem to use: ``--url``, or one started here (stopped at the end)."""
    if args.url is not None:
        yield args.url.rstrip("/")
        return
    import socket
    import tempfile

    from tandem_tools.bench.servers import Server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    what = ["--config", args.config] if args.config else [args.model, *args.extra]
    argv = [sys.executable, "-m", "tandem_tools.cli", "--log-level", "warning", "serve", *what,
            "--host", "127.0.0.1", "--port", str(port)]
    log = Path(tempfile.mkdtemp(prefix="tandem-run-batch-")) / "serve.log"
    with Server("tandem serve", argv, port, "/ready", log, dict(os.environ)) as server:
        try:
            server.wait_ready(args.ready_timeout)
        except RuntimeError as e:
            raise SystemExit(f"tandem run-batch: {e}") from None
        _wait_all_ready(f"http://127.0.0.1:{port}", args.ready_timeout)
        yield f"http://127.0.0.1:{port}"


def _wait_all_ready(url: str, timeout: float) -> None:
    """/ready is 200 once one model serves: wait for every one (a config of several)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).json().get("all_ready"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    raise SystemExit(f"tandem run-batch: not every model ready in {timeout:.0f} s")
