"""lm-evaluation-harness on an offline stack: a small task set of its own (a multiple-choice task,
scored by echo + logprobs, and a generate_until task) and one call of ``simple_evaluate``; shared
by the tests that point lm-eval at a stack (``test_diffusion_eval_clients``, ``test_default_config``)."""

import json
from pathlib import Path

from workers import tiny_models

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


def write_tasks(root: Path) -> Path:
    """The task files under ``root`` (its ``include_path``)."""
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (root / "tandem_mc.yaml").write_text(MC_TASK.format(data=data))
    (root / "tandem_gen.yaml").write_text(GEN_TASK.format(data=data))
    return root


def evaluate(model: str, model_args: dict, tasks: Path, names: list[str], **kwargs) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=names,
                           task_manager=TaskManager(include_path=str(tasks)), **kwargs)




def check_local_completions(url: str, model: str, tasks: Path) -> None:
    """lm-eval's ``local-completions`` with its defaults: token-id prompts (tokenized_requests), a
    loglikelihood request per choice (echo, logprobs 1, max_tokens 1, temperature 0), generate_until
    with stop strings; every request must succeed, whatever a random model writes."""
    import math

    tokenizer = str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))
    out = evaluate("local-completions", {"model": model, "base_url": url + "/v1/completions", "tokenizer": tokenizer},
                   tasks, ["tandem_mc", "tandem_gen"])
    mc, gen = out["results"]["tandem_mc"], out["results"]["tandem_gen"]
    assert 0.0 <= mc["acc,none"] <= 1.0 and not math.isnan(mc["acc,none"])
    assert 0.0 <= gen["exact_match,none"] <= 1.0
    assert out["n-samples"]["tandem_mc"]["effective"] == len(QUESTIONS)
    assert out["n-samples"]["tandem_gen"]["effective"] == len(QUESTIONS)
