"""The evaluation and load tools people point at a vLLM server, as shipped and with their defaults,
against the diffusion model: lm-evaluation-harness (``local-completions``: a multiple-choice
task, scored by echo + logprobs, and a generate_until task, both with token-id prompts; and
``local-chat-completions``) and guidellm (its default request body, ``ignore_eos`` included).
Only what an offline run must say is added: the model's local tokenizer, a task file, and a
small request count. Whatever a random model writes, every request must succeed."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from workers import tiny_models

MODEL = "tiny-diffusiongemma"

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Rome", "Berlin"], 0),
    ("Which is a colour?", ["seven", "blue", "quickly"], 1),
    ("What do bees make?", ["steel", "glass", "honey"], 2),
]

MC_TASK = """\
task: tandem_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""

GEN_TASK = """\
task: tandem_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 24
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (root / "tandem_mc.yaml").write_text(MC_TASK.format(data=data))
    (root / "tandem_gen.yaml").write_text(GEN_TASK.format(data=data))
    return root


def _evaluate(model: str, model_args: dict, tasks: Path, names: list[str], **kwargs) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=names,
                           task_manager=TaskManager(include_path=str(tasks)), **kwargs)


def test_lm_eval_local_completions_scores_and_generates(stack, tasks):
    """lm-eval's defaults: token-id prompts (tokenized_requests), a loglikelihood request per
    choice (echo, logprobs 1, max_tokens 1, temperature 0), generate_until with stop strings."""
    tokenizer = str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))
    out = _evaluate("local-completions", {"model": MODEL, "base_url": stack.url + "/v1/completions",
                                          "tokenizer": tokenizer}, tasks, ["tandem_mc", "tandem_gen"])
    mc, gen = out["results"]["tandem_mc"], out["results"]["tandem_gen"]
    assert 0.0 <= mc["acc,none"] <= 1.0 and not math.isnan(mc["acc,none"])
    assert 0.0 <= gen["exact_match,none"] <= 1.0
    assert out["n-samples"]["tandem_mc"]["effective"] == len(QUESTIONS)
    assert out["n-samples"]["tandem_gen"]["effective"] == len(QUESTIONS)


def test_lm_eval_local_chat_completions_generates(stack, tasks):
    tokenizer = str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))
    out = _evaluate("local-chat-completions", {"model": MODEL, "base_url": stack.url + "/v1/chat/completions",
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
