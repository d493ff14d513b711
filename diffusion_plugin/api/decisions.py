"""Decisions on diffusion models: OpenAI's ``/v1/decisions`` and vLLM's ``/v1/systemone`` (its
request and response shape), read by tandem's batcher.

A probe (``tandem_core.label_reads``) is a sequence whose prompt is the question's prompt plus
a label's prefix, and whose one block is a read-only pass (``request.Sequence.read_ids``): a
canvas of noise that depends on the position only, read once at temperature 1, the candidates'
log-softmax taken at its first position, nothing committed. Like vLLM's DiffusionGemma strategy,
the read runs on a 16-wide canvas (``request.READ_CANVAS``): the reads of a step share one decoder
forward of their own, beside the step's other rows, and the head runs on the first position
alone. The probes of a question share its prompt's KV
through the prefix cache (fast mode). A read is batch-invariant in fast mode: the same request
gives the same probabilities whatever shares the batch.

Images: on a family with vision, a question's images are encoded once per request (every
question shows the input's) and each probe's prompt pass reads them (no prefix cache for a prompt
with images, as for any request).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from diffusion_plugin.api.images import extract_images
from diffusion_plugin.batcher.loop import EventKind
from diffusion_plugin.batcher.request import SamplingParams as Knobs
from diffusion_plugin.batcher.request import SeqStatus, Sequence
from tandem_core import decisions as D
from tandem_core.errors import ErrorKind, TandemError, invalid
from tandem_core.label_reads import Ask, Probe, ProbeResult, read_labels
from tandem_core.protocol import Item

UNBOUNDED_LEN = 1 << 20  # a family without a position limit


class DiffusionReader:
    """``tandem_core.label_reads.Reader`` over a started ``DiffusionEngine``."""

    def __init__(self, engine, request_id: str, priority: int = 0, template_kwargs: dict | None = None):
        self.engine = engine
        self.sees = bool(engine.adapter.has_vision)
        self._encoded: dict[str, asyncio.Future] = {}  # a question's image parts -> their encoding
        self._images: dict[tuple, object] = {}  # a rendered prompt -> its encoded images
        self.tokenizer = engine.adapter.tokenizer
        self.max_len = engine.adapter.max_position or UNBOUNDED_LEN
        self.chunk = 4 * engine.max_batch  # the rest waits in the engine, not in the scheduler's queue
        self.request_id = request_id
        self.priority = priority
        self.template_kwargs = template_kwargs
        self._n = 0

    async def render(self, messages: list[dict], salt: str | None) -> list[int]:
        intake = self.engine.intake
        shown, sources = extract_images(messages, self.engine.image_limits)
        if not sources:
            return list(intake.prompt_ids(messages, None, template_kwargs=self.template_kwargs))
        key = json.dumps([p for m in messages if isinstance(m.get("content"), list) for p in m["content"]
                          if p.get("type") == "image_url"])
        if key not in self._encoded:  # one vision pass per distinct set of images in the request
            self._encoded[key] = asyncio.ensure_future(intake.images(messages))
        images = (await self._encoded[key])[1]
        ids = intake.prompt_ids(shown, None, template_kwargs=self.template_kwargs)
        try:
            ids = self.engine.adapter.expand_image_tokens(ids, images.num_soft_tokens)
        except ValueError as e:
            raise invalid(f"input: {e}", "input") from None
        self._images[tuple(ids)] = images
        return list(ids)

    async def probe(self, probes: list[Probe], salt: str | None) -> list[ProbeResult]:
        seqs = []
        for p in probes:
            self._n += 1
            knobs = Knobs(max_tokens=0, max_denoising_steps=1, entropy_bound=0.0, t_min=1.0, t_max=1.0,
                          stability_threshold=1, confidence_threshold=0.0, seed=0)
            seqs.append(Sequence(seq_id=f"{self.request_id}-r{self._n}", prompt_ids=list(p.prompt_ids), params=knobs,
                                 read_ids=tuple(p.candidates), cache_salt=salt, priority=self.priority,
                                 images=self._images.get(tuple(p.prompt_ids[:p.prompt_len]))))
        async with self.engine.submitted(self.request_id, seqs) as queue:
            left = len(seqs)
            while left:
                ev = await queue.get()
                if ev.kind is EventKind.FINISHED:
                    left -= 1
                    if ev.seq.status is not SeqStatus.FINISHED_LENGTH:
                        raise TandemError(ErrorKind.ENGINE_ERROR, f"a label read ended {ev.seq.status.name.lower()}"
                                          + (f": {ev.seq.error}" if ev.seq.error else ""))
        out = []
        for p, s in zip(probes, seqs, strict=True):
            top = next((c for c, sc in zip(p.candidates, s.scores, strict=True) if sc.rank == 1), -1)
            out.append(ProbeResult([sc.logprob for sc in s.scores], top, s.cached_tokens))
        return out


def serve(engine, body: dict, request_id: str, route: str) -> AsyncIterator[Item]:
    """The engine's ``decisions`` and ``systemone`` routes: one answer, or its error."""
    return _once(engine, body, request_id, decisions if route == "decisions" else systemone)


async def _once(engine, body, request_id, handle) -> AsyncIterator[Item]:
    try:
        out = await handle(engine, body, request_id)
    except TandemError as e:
        out = e
    yield out


async def decisions(engine, body: dict, request_id: str) -> dict:
    return await D.decide(body, engine.model, lambda priority: DiffusionReader(engine, request_id, priority))


async def systemone(engine, body: dict, request_id: str) -> dict:
    """vLLM's ``/v1/systemone``: its request model, its question types (prompts, labels, answers)
    and its response model; the labels read by tandem's batcher."""
    from vllm.entrypoints.generate.structured_decisions import protocol as V
    from vllm.entrypoints.generate.structured_decisions.question_types import LABELS, StructuredDecisionError
    from vllm.entrypoints.generate.structured_decisions.serving import parse_questions
    from vllm.entrypoints.generate.structured_decisions.strategies import DecisionLimits, state_text

    from diffusion_plugin.api.structured import request_errors

    with request_errors(body):
        request = V.StructuredDecisionRequest.model_validate(body)
    try:
        questions = parse_questions(request, DecisionLimits(max_questions=64, max_options=len(LABELS)))
        if request.audio or request.videos or (request.images and not engine.adapter.has_vision):
            raise StructuredDecisionError("this model does not take "
                                          + ("audio or video" if request.audio or request.videos else "image")
                                          + " inputs")
        if (request.chat_template_kwargs or {}).get("enable_thinking"):
            raise StructuredDecisionError("a read is the reply's first token, so thinking must be off")
    except StructuredDecisionError as e:
        raise invalid(str(e), param="questions") from None
    state = state_text(request.state)
    head = [{"role": "system", "content": request.instructions}] if request.instructions else []
    shown = [{"type": "image_url", "image_url": {"url": url}} for url in request.images or []]

    def turn(text: str) -> dict:
        return {"role": "user", "content": [*shown, {"type": "text", "text": text}] if shown else text}

    asks = [Ask([*head, turn(f"{state}\n\n{q.type.prompt(q)}")], q.labels, bool(shown)) for q in questions]
    reader = DiffusionReader(engine, request_id, request.priority, request.chat_template_kwargs)
    reads = await read_labels(reader, asks, request.cache_salt)
    refused = next((r.refusal for r in reads if r.refusal), None)
    if refused:
        raise invalid(refused, param="questions")
    return V.StructuredDecisionResponse(
        id=f"decision-{request_id}", model=body.get("model") or engine.model,
        answers={q.id: q.type.answer(q, r.probs, r.label_mass) for q, r in zip(questions, reads, strict=True)},
        usage=V.DecisionUsage(input_tokens=sum(r.input_tokens for r in reads), output_tokens=0),
        diagnostics={q.id: V.QuestionDiagnostics(label_mass=r.label_mass, argmax_is_label=r.argmax_is_label)
                     for q, r in zip(questions, reads, strict=True)}).model_dump(mode="json")
