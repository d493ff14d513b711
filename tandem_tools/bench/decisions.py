"""Decisions (issue 37): questions per second and CPU per question of ``POST /v1/decisions`` with
1, 10 and 100 questions a request, against the same questions asked as separate one-token chat
completions (all at once, each its own request), in interleaved rounds. One `tandem serve` per
model, one alive at a time; CPU is the server's whole process tree (gateway, Ray, replicas).

    python -m tandem_tools.bench.decisions            (or: tandem bench --mode decisions)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

import httpx
import yaml

from tandem_tools.bench import procstat
from tandem_tools.bench.common import per_model
from tandem_tools.bench.servers import Server, prompts

REPO = Path(__file__).resolve().parents[2]
logger = logging.getLogger("tandem.bench")
MODELS = {
    "tiny-llama": {"kind": "autoregressive", "source": "builtin:tiny-llama", "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                   "engine_args": {"enforce_eager": True, "max_model_len": 1024, "dtype": "float32"}},
    "tiny-diffusiongemma": {"kind": "diffusion", "source": "builtin:tiny-diffusiongemma",
                            "engine_args": {"max_batch": 8, "sampler": "fast"}},
    "shape-diffusiongemma": {"kind": "diffusion", "source": "builtin:shape-diffusiongemma",
                             "engine_args": {"max_batch": 4, "sampler": "fast"}},
}


def questions(n: int) -> list[dict]:
    """Alternately a predicate and a 3-way choice (single-token labels A..C; yes/no may be several)."""
    out = []
    for i in range(n):
        if i % 2:
            out.append({"type": "choice", "instructions": f"Which team should take ticket aspect {i}?",
                        "choices": [{"value": "billing"}, {"value": "shipping"}, {"value": "support"}]})
        else:
            out.append({"type": "predicate", "instructions": f"Aspect {i} of the ticket is urgent."})
    return out


def chat_text(text: str, q: dict) -> str:
    """The question as one chat message (what a client without the Decisions API sends)."""
    if q["type"] == "predicate":
        return f"{text}\n\nStatement: {q['instructions']}\nIs this statement true? Answer with yes or no only."
    options = "\n".join(f"{chr(65 + i)}: {c['value']}" for i, c in enumerate(q["choices"]))
    return f"{text}\n\nQuestion: {q['instructions']}\n{options}\nAnswer with the letter of one option only."


async def decide(client: httpx.AsyncClient, url: str, model: str, text: str, qs: list[dict]) -> int:
    r = await client.post(url + "/v1/decisions", json={"model": model, "input": text, "questions": qs})
    r.raise_for_status()
    return len(r.json()["answers"])


CHAT_EXTRA: dict = {}  # --chat-steps: the diffusion knobs of the one-token chat completions


async def separately(client: httpx.AsyncClient, url: str, model: str, text: str, qs: list[dict]) -> int:
    async def one(q: dict) -> None:
        r = await client.post(url + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": chat_text(text, q)}], "max_tokens": 1,
            "temperature": 0, "logprobs": True, "top_logprobs": 5,
            **(CHAT_EXTRA if MODELS[model]["kind"] == "diffusion" else {})})
        r.raise_for_status()
    await asyncio.gather(*(one(q) for q in qs))
    return len(qs)


def phase(server: Server, url: str, model: str, how, n: int, requests: int, seed: int) -> dict:
    texts = prompts(requests, seed=seed)

    async def run() -> int:
        async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=n + 4)) as client:
            done = 0
            for text in texts:  # one request (or its n chat completions) at a time
                done += await how(client, url, model, text, questions(n))
            return done

    pids = procstat.tree(server.proc.pid)
    cpu0, t0 = sum(map(procstat.cpu_s, pids)), time.monotonic()
    done = asyncio.run(run())
    wall = time.monotonic() - t0
    cpu = sum(map(procstat.cpu_s, procstat.tree(server.proc.pid))) - cpu0
    return {"questions": done, "wall_s": wall, "cpu_s": cpu, "qps": done / wall, "cpu_ms_per_q": 1000 * cpu / done}


def run_model(model: str, args, workdir: Path) -> dict:
    cfg = {"gateway": {"port": args.port}, "ray": {"num_cpus": 2}, "models_dir": str(REPO / "models"),
           "models": [{"name": model, "replicas": 1, "resources": {"num_gpus": 0, "num_cpus": 1}, **MODELS[model]}]}
    path = workdir / f"{model}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    tandem = str(Path(sys.executable).parent / "tandem")
    loads = [int(x) for x in args.questions.split(",")]
    out: dict = {str(n): {"decisions": [], "chat": []} for n in loads}
    with Server(f"tandem-{model}", [tandem, "serve", "--config", str(path)], args.port, f"/ready?model={model}",
                workdir / f"{model}.log", dict(os.environ)) as server:
        server.wait_ready(args.ready_timeout)
        url = f"http://127.0.0.1:{args.port}"
        phase(server, url, model, decide, 2, 1, seed=999)  # warm both paths
        phase(server, url, model, separately, 2, 1, seed=999)
        for rnd in range(args.rounds):
            for n in loads:
                requests = max(1, args.questions_per_phase // n)
                order = (("decisions", decide), ("chat", separately))
                for name, how in (order if rnd % 2 == 0 else order[::-1]):
                    out[str(n)][name].append(phase(server, url, model, how, n, requests, seed=rnd * 100 + n))
                    logger.info("%s n=%d %s: %s", model, n, name, out[str(n)][name][-1])
    return out


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def report(model: str, r: dict) -> str:
    lines = [f"\n== {model} ==", f"{'questions/request':>18} {'decisions q/s':>14} {'chat q/s':>9} "
             f"{'decisions CPU ms/q':>19} {'chat CPU ms/q':>14} {'CPU chat/decisions':>19}"]
    for n, x in r.items():
        d = {k: _median([p[k] for p in x["decisions"]]) for k in ("qps", "cpu_ms_per_q")}
        c = {k: _median([p[k] for p in x["chat"]]) for k in ("qps", "cpu_ms_per_q")}
        lines.append(f"{n:>18} {d['qps']:14.1f} {c['qps']:9.1f} {d['cpu_ms_per_q']:19.0f} {c['cpu_ms_per_q']:14.0f} "
                     f"{c['cpu_ms_per_q'] / d['cpu_ms_per_q']:18.2f}x")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="tiny-llama,tiny-diffusiongemma,shape-diffusiongemma")
    p.add_argument("--questions", default="1,10,100", help="questions per request, comma-separated")
    p.add_argument("--questions-per-phase", type=int, default=100,
                   help="questions asked per phase (requests = this / questions per request; default 100)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--chat-steps", type=int, default=None,
                   help="diffusion models: the chat completions' diffusion.max_denoising_steps (default: the "
                        "model's, 48 at the real shape; 1 is the cheapest one-token chat a client can ask)")
    p.add_argument("--port", type=int, default=8152)
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--out", help="write the results as JSON here")


def _chat_steps(args) -> None:
    if args.chat_steps is not None:
        CHAT_EXTRA["diffusion"] = {"max_denoising_steps": args.chat_steps}


def main(argv: list[str] | None = None) -> int:
    return per_model(argv, __doc__, add_arguments, "/tmp/tandem-bench-decisions", run_model, report, _chat_steps)


if __name__ == "__main__":
    sys.exit(main())
