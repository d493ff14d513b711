"""vLLM's own offline `LLM` on the same model and arguments: the parity reference.

Run as a script (vLLM spawns processes): reads a JSON job on stdin, writes JSON on stdout.
"""

import json
import sys


def main() -> None:
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], **job["engine_args"])
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"])
    completions = llm.generate(job["prompts"], params, use_tqdm=False)
    chats = llm.chat(job["chats"], params, use_tqdm=False)
    out = {
        "completions": [{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids)} for o in completions],
        "chats": [{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids)} for o in chats],
    }
    sys.stdout.write("\nRESULT " + json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
