"""The evaluation and load tools people point at a vLLM server, as shipped and with their defaults,
against the diffusion model: lm-evaluation-harness (``local-completions``: a multiple-choice
task, scored by echo + logprobs, and a generate_until task, both with token-id prompts; and
``local-chat-completions``) and guidellm (its default request body, ``ignore_eos`` included).
Only what an offline run must say is added: the model's local tokenizer, a task file, and a
small request count. Whatever a random model writes, every request must succeed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.evals import QUESTIONS, check_local_completions, evaluate, write_tasks
from workers import tiny_models

MODEL = "tiny-diffusiongemma"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


def test_lm_eval_local_completions_scores_and_generates(stack, tasks):
    check_local_completions(stack.url, MODEL, tasks)


def test_lm_eval_local_chat_completions_generates(stack, tasks):
    tokenizer = str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))
    out = evaluate("local-chat-completions", {"model": MODEL, "base_url": stack.url + "/v1/chat/completions",
                                               "tokenizer": tokenizer}, tasks, ["tandem_gen"],
                    apply_chat_template=True)
    assert 0.0 <= out["results"]["tandem_gen"]["exact_match,none"] <= 1.0
    assert out["n-samples"]["tandem_gen"]["effective"] == len(QUESTIONS)


def test_guidellm_with_its_defaults_has_no_errors(stack, tmp_path):
    """guidellm's default backend (OpenAI HTTP, streamed, ``ignore_eos: true``) and synthetic data,
    bounded by a request count; its JSON report must count every request as successful."""
    tokenizer = str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))
    cmd = [str(Path(sys.executable).parent / "guidellm"), "run",
           "--backend", f"kind=openai_http,target={stack.url},model={MODEL}",
           "--profile", "kind=synchronous",
           "--constraint", "kind=max_requests,count=6",
           "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=24",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", "kind=json",  # benchmarks.json in its working directory
           "--disable-console-interactive"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bench = json.loads((tmp_path / "benchmarks.json").read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["incomplete"] == 0 and totals["successful"] == 6, totals
    sent = [json.loads(r["request_args"])["body"] for r in bench["requests"]["successful"]]
    assert all(b["ignore_eos"] is True and b["stream"] is True for b in sent)  # what the issue saw refused
    # ignore_eos honoured: every answer is exactly the tokens asked for
    assert [r["output_tokens"] for r in bench["requests"]["successful"]] == [24] * 6
