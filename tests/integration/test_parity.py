"""tandem's output equals vLLM's own LLM.generate/LLM.chat, token for token, at temperature 0."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.stack import ENGINE_ARGS

MAX_TOKENS = 24
PROMPTS = [
    "The river bends twice",
    "Question: What is the capital of France? Answer:",
    "def add(a, b):",
    "Numbers and dates appear everywhere:",
    "Hello! How are you today?",
    "A",
    "The library opens at nine and closes at six. Students arrive with laptops and",
    "Good software is boring in the best way.",
]
CHATS = [[{"role": "user", "content": p}] for p in PROMPTS]


def _reference(model_path: Path) -> dict:
    job = {"model": str(model_path), "engine_args": ENGINE_ARGS, "prompts": PROMPTS, "chats": CHATS,
           "max_tokens": MAX_TOKENS}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_reference.py"))],
                          input=json.dumps(job), capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_parity_with_vllm_offline(stack):
    ref = _reference(stack.model_path)

    async def tandem():
        client = stack.async_client()
        extra = {"return_token_ids": True}
        comps = [client.completions.create(model="tiny-llama", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=extra) for p in PROMPTS]
        chats = [client.chat.completions.create(model="tiny-llama", messages=m, max_tokens=MAX_TOKENS,
                                                temperature=0, extra_body=extra) for m in CHATS]
        return await asyncio.gather(*comps), await asyncio.gather(*chats)  # concurrently: they share batches

    comps, chats = asyncio.run(tandem())
    for i, (got, want) in enumerate(zip(comps, ref["completions"], strict=True)):
        assert got.choices[0].model_extra["token_ids"] == want["token_ids"], f"completion {i}: {PROMPTS[i]!r}"
        assert got.choices[0].text == want["text"]
    for i, (got, want) in enumerate(zip(chats, ref["chats"], strict=True)):
        assert got.choices[0].model_extra["token_ids"] == want["token_ids"], f"chat {i}: {PROMPTS[i]!r}"
        assert got.choices[0].message.content == want["text"]
