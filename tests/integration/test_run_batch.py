"""`tandem run-batch` against `vllm run-batch` on the same model (issue 34): one output line per
input line, in order; the chat lines answered as `vllm run-batch` answers them (status, greedy
text), and the completions lines too (which `vllm run-batch` 0.32 refuses: its input takes no
`/v1/completions` lines). tandem starts its own server for MODEL (`tandem serve MODEL`'s flags),
answers through its Batch API and stops it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.integration.stack import REPO

FLAGS = ["--max-model-len", "512", "--dtype", "float32", "--enforce-eager"]


def _lines() -> list[dict]:
    chat = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "MODEL", "max_tokens": 12, "temperature": 0,
                      "messages": [{"role": "user", "content": f"Say something about {i}."}]}} for i in range(5)]
    completions = [{"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "MODEL", "max_tokens": 12, "temperature": 0, "prompt": f"The number {i} is"}}
                   for i in range(5)]
    return [x for pair in zip(chat, completions, strict=True) for x in pair]


def _text(answer: dict) -> str:
    choice = answer["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_tandem_run_batch_answers_what_vllm_run_batch_answers(tmp_path):
    model = "models/tiny-llama"  # (relative to the repo, where both commands run)
    src = tmp_path / "in.jsonl"
    lines = _lines()
    for line in lines:
        line["body"]["model"] = model  # both name the model by its path, as `vllm run-batch --model` serves it
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    ours, theirs = tmp_path / "tandem.jsonl", tmp_path / "vllm.jsonl"
    subprocess.run([sys.executable, "-m", "tandem_tools.cli", "run-batch", model, "-i", str(src), "-o", str(ours),
                    *FLAGS], cwd=REPO, env=env, check=True, timeout=900, process_group=0)
    chat_only = tmp_path / "chat.jsonl"
    chat_only.write_text("".join(json.dumps(x) + "\n" for x in lines if x["url"] == "/v1/chat/completions"))
    subprocess.run([sys.executable, "-m", "tandem_tools.vllm_cli_shim", "run-batch", "-i", str(chat_only), "-o",
                    str(theirs), "--model", model, *FLAGS], cwd=REPO, env=env, check=True, timeout=900,
                   process_group=0)
    mine = [json.loads(x) for x in ours.read_text().splitlines()]
    ref = {a["custom_id"]: a for a in map(json.loads, theirs.read_text().splitlines())}
    assert [a["custom_id"] for a in mine] == [x["custom_id"] for x in lines]
    for a in mine:
        assert a["response"]["status_code"] == 200 and _text(a), a
    assert sorted(ref) == sorted(a["custom_id"] for a in mine if a["custom_id"].startswith("chat-"))
    for a in mine:
        if a["custom_id"] not in ref:
            continue
        b = ref[a["custom_id"]]
        assert a["response"]["status_code"] == b["response"]["status_code"] == 200, (a, b)
        assert _text(a) == _text(b), (a["custom_id"], _text(a), _text(b))
