"""OpenAI's Decisions API (``POST /v1/decisions``): the request, the questions as the model reads
them, and the answers. Both engines share it, so one request means the same on both model kinds;
each engine only renders chat messages to token ids and reads label logprobs
(``tandem_core.label_reads``).

A question becomes one chat prompt: the input as a conversation, then a user turn that asks the
question and lists its options, each under a label (a predicate: ``yes``/``no``; a choice:
``A``..``Z``, or two letters past 26 choices; a score: ``0``..``9``, or two digits past 10
levels). Labels of one question have the same length, so no label's text starts another's. A
label's probability is that of its whole token sequence as the reply's start (a label may be
several tokens: "yes" is two on tiny-llama); a question's probabilities are the labels'
renormalised over the labels, and ``confidence`` is the top one's share of the whole vocabulary.

Input items that are not messages (function calls, custom tool calls and their outputs) are
written into the conversation as text, so every chat template reads them the same way. A
question the model cannot read (its prompt does not fit the context, or it shows an image to a
model that does not see) gets a ``refusal``; the others are still answered.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from tandem_core.errors import invalid
from tandem_core.label_reads import Ask, Reader, read_labels

MAX_QUESTIONS = 400  # OpenAI's bound
MAX_CHOICES = 255  # OpenAI's bound
MAX_LEVELS = 100  # two-digit labels


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Breakpoint(_Strict):
    mode: Literal["explicit"]


class InputText(_Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: _Breakpoint | None = None  # accepted: tandem's prefix cache is automatic


class InputImage(_Strict):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["low", "high", "auto", "original"] | None = None
    prompt_cache_breakpoint: _Breakpoint | None = None


class InputJSON(_Strict):
    type: Literal["input_json"]
    data: dict[str, Any] | list[dict[str, Any]]


class OutputText(_Strict):
    type: Literal["output_text"]
    text: str


class OutputRefusal(_Strict):
    type: Literal["refusal"]
    refusal: str


Part = Annotated[InputText | InputImage | InputJSON, Field(discriminator="type")]
AssistantPart = Annotated[OutputText | OutputRefusal, Field(discriminator="type")]


class Message(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "developer", "system", "assistant"]
    content: str | list[Part | AssistantPart]
    phase: Literal["commentary", "final_answer"] | None = None


class _Call(_Strict):
    call_id: str = Field(min_length=1)
    name: str
    id: str | None = None
    namespace: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCall(_Call):
    type: Literal["function_call"]
    arguments: str


class CustomToolCall(_Call):
    type: Literal["custom_tool_call"]
    input: str


class _Output(_Strict):
    call_id: str = Field(min_length=1)
    output: str | list[Annotated[InputText | InputImage, Field(discriminator="type")]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutput(_Output):
    type: Literal["function_call_output"]


class CustomToolCallOutput(_Output):
    type: Literal["custom_tool_call_output"]


# The input item and question models by ``type`` (``parse`` reads with them; so does the OpenAPI body).
ITEMS = {"message": Message, "function_call": FunctionCall, "function_call_output": FunctionCallOutput,
          "custom_tool_call": CustomToolCall, "custom_tool_call_output": CustomToolCallOutput}


class _Question(_Strict):
    instructions: str | list[Annotated[InputText | InputImage | InputJSON, Field(discriminator="type")]]
    name: str | None = None


class Predicate(_Question):
    type: Literal["predicate"]


class ChoiceOption(_Strict):
    value: StrictStr | StrictBool
    description: str | None = None


class Choice(_Question):
    type: Literal["choice"]
    choices: list[ChoiceOption] = Field(min_length=2, max_length=MAX_CHOICES)


class Level(_Strict):
    label: str
    description: str | None = None


class Score(_Question):
    type: Literal["score"]
    levels: list[Level] = Field(min_length=2, max_length=MAX_LEVELS)


QUESTIONS = {"predicate": Predicate, "choice": Choice, "score": Score}


class _Cache(_Strict):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] = "30m"


class DecisionRequest(_Strict):
    model: str
    input: str | list[dict[str, Any]]
    questions: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_QUESTIONS)
    # The gateway's routing key (``gateway.request.intake``: like ``user``, requests with one key go to one
    # replica, where their prefix is cached); not a salt: keys do not partition the cache.
    prompt_cache_key: str | None = None
    prompt_cache_options: _Cache | None = None  # accepted: tandem's prefix cache is automatic
    safety_identifier: str | None = Field(default=None, max_length=64)  # accepted: tandem monitors no abuse
    priority: int = 0  # vLLM's extension: lower is more urgent (the gateway sets it from the API key)


@dataclass(frozen=True)
class Question:
    """One question as the model reads it: ``messages`` (the conversation, then the question's
    turn), and per option its label and the value its answer names."""

    index: int
    name: str | None
    type: str
    messages: list[dict]
    labels: tuple[str, ...]
    values: tuple  # a choice's typed values; a score's level labels; a predicate's (True, False)
    images: bool  # whether the question's own instructions show an image


@dataclass(frozen=True)
class Decisions:
    questions: list[Question]
    input_images: bool
    priority: int = 0


def parse(body: dict) -> Decisions:
    """The request's questions, each a chat prompt with its labels. A 400 names the field."""
    req = _validated(DecisionRequest, body, "")
    conversation = _conversation(req.input)
    questions = [_question(i, q, conversation) for i, q in enumerate(req.questions)]
    return Decisions(questions, any(_has_image(m) for m in conversation), req.priority)


def _validated(model: type[BaseModel], value: Any, where: str):
    try:
        return model.model_validate(value)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in (where.split(".") if where else []) + list(err["loc"]))
        raise invalid(f"{loc or 'body'}: {err['msg']}", param=loc.split(".")[0] if loc else None) from None


def _typed(kinds: dict, value: Any, where: str, default: str | None = None):
    if not isinstance(value, dict):
        raise invalid(f"{where}: must be an object", param=where.split(".")[0])
    kind = value.get("type", default)
    cls = kinds.get(kind)
    if cls is None:
        raise invalid(f"{where}.type: must be one of {', '.join(kinds)} (got {kind!r})", param=where.split(".")[0])
    return _validated(cls, value, where)


# -- the conversation ------------------------------------------------------------------------------
def _conversation(value: str | list) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise invalid("input: must not be empty", param="input")
    out, calls = [], set()
    for i, raw in enumerate(value):
        item = _typed(ITEMS, raw, f"input.{i}", default="message")
        if isinstance(item, Message):
            role = "system" if item.role == "developer" else item.role
            allowed = (OutputText, OutputRefusal) if role == "assistant" else (
                (InputText,) if role == "system" else (InputText, InputImage, InputJSON))
            if isinstance(item.content, list) and not all(isinstance(p, allowed) for p in item.content):
                kinds = ", ".join(sorted({p.type for p in item.content if not isinstance(p, allowed)}))
                raise invalid(f"input.{i}.content: a {item.role} message cannot hold {kinds} parts",
                              param="input")
            out.append({"role": role, "content": _content(item.content)})
        elif isinstance(item, FunctionCall | CustomToolCall):
            calls.add(item.call_id)
            said = item.arguments if isinstance(item, FunctionCall) else item.input
            out.append({"role": "assistant", "content": f"[tool call {item.call_id}] {item.name}: {said}"})
        else:
            if item.call_id not in calls:
                raise invalid(f"input.{i}.call_id: no earlier call has call_id {item.call_id!r}", param="input")
            parts = _content(item.output)
            head = f"[output of tool call {item.call_id}]"
            out.append({"role": "user", "content": f"{head} {parts}" if isinstance(parts, str)
                        else [{"type": "text", "text": head}, *parts]})
    return out


def _content(content: str | list) -> str | list[dict]:
    """Text as it is; parts as chat parts (JSON as its text)."""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        if isinstance(p, InputImage):
            parts.append({"type": "image_url", "image_url": {"url": p.image_url}})
        else:
            text = p.text if isinstance(p, InputText | OutputText) else (
                p.refusal if isinstance(p, OutputRefusal) else json.dumps(p.data, ensure_ascii=False))
            parts.append({"type": "text", "text": text})
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _has_image(message: dict) -> bool:
    return isinstance(message["content"], list) and any(p["type"] == "image_url" for p in message["content"])


def _merged(messages: list[dict]) -> list[dict]:
    """Consecutive turns of one role become one (templates that need alternating roles)."""
    out: list[dict] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"]:
            a, b = out[-1]["content"], m["content"]
            if isinstance(a, str) and isinstance(b, str):
                content = f"{a}\n\n{b}"
            else:
                content = [*_parts(a), *_parts(b)]
            out[-1] = {"role": m["role"], "content": content}
        else:
            out.append(dict(m))
    return out


def _parts(content: str | list) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


# -- the questions ---------------------------------------------------------------------------------
def _question(i: int, raw: Any, conversation: list[dict]) -> Question:
    q = _typed(QUESTIONS, raw, f"questions.{i}")
    if isinstance(q, Predicate):
        labels, values = ("yes", "no"), (True, False)
        ask = "Is this statement about the input true? Answer with yes or no only."
        lines: list[str] = []
    elif isinstance(q, Choice):
        keys = [(type(c.value), c.value) for c in q.choices]
        if len(set(keys)) != len(keys):
            raise invalid(f"questions.{i}.choices: each choice must be unique", param="questions")
        labels = _codes(string.ascii_uppercase, len(q.choices))
        values = tuple(c.value for c in q.choices)
        lines = [_line(label, _text(c.value), c.description) for label, c in zip(labels, q.choices, strict=True)]
        ask = "Answer with the letters of one option only." if len(labels[0]) > 1 else \
            "Answer with the letter of one option only."
    else:
        labels = _codes(string.digits, len(q.levels))
        values = tuple(level.label for level in q.levels)
        lines = [_line(label, level.label, level.description) for label, level in zip(labels, q.levels, strict=True)]
        ask = "Answer with the number of one level only."
    instructions = _content(q.instructions)
    head = "Statement: " if isinstance(q, Predicate) else "Question: "
    tail = "\n".join([*lines, ask])
    if isinstance(instructions, str):
        turn: str | list = f"{head}{instructions}\n{tail}"
    else:
        turn = [{"type": "text", "text": head}, *instructions, {"type": "text", "text": tail}]
    messages = _merged([*conversation, {"role": "user", "content": turn}])
    return Question(i, q.name, q.type, messages, labels, values, not isinstance(instructions, str) and any(
        p["type"] == "image_url" for p in instructions))


def _codes(alphabet: str, n: int) -> tuple[str, ...]:
    """``n`` labels of one length: single symbols while they last, then pairs."""
    if n <= len(alphabet):
        return tuple(alphabet[:n])
    return tuple(a + b for a in alphabet for b in alphabet)[:n]


def _line(label: str, name: str, description: str | None) -> str:
    return f"{label}: {name} - {description}" if description else f"{label}: {name}"


def _text(value: str | bool) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else value


# -- the answers -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Read:
    """A question's read: each label's probability among the labels (sums to 1) and the labels'
    total probability over the vocabulary; or ``refusal`` (why it was not read)."""

    probs: list[float] | None = None
    label_mass: float = 0.0
    refusal: str | None = None


def answer(q: Question, read: Read) -> dict:
    """The answer to ``q`` in the SDK's ``Decision`` shape."""
    if read.probs is None:
        return {"type": "refusal", "name": q.name}
    probs = read.probs
    top = max(range(len(probs)), key=probs.__getitem__)
    if q.type == "predicate":
        return {"type": "predicate", "name": q.name, "probability": probs[0]}
    confidence = probs[top] * read.label_mass
    if q.type == "choice":
        return {"type": "choice", "name": q.name, "choice": q.values[top], "confidence": confidence,
                "probabilities": [{"value": v, "probability": p} for v, p in zip(q.values, probs, strict=True)]}
    return {"type": "score", "name": q.name, "score": sum(i * p for i, p in enumerate(probs)),
            "confidence": confidence,
            "probabilities": [{"label": v, "value": i, "probability": p}
                              for i, (v, p) in enumerate(zip(q.values, probs, strict=True))]}


def decision(model: str, questions: list[Question], reads: list[Read], input_tokens: int,
             cached_tokens: int) -> dict:
    """The response body (OpenAI's ``Decision``). A read generates no tokens: ``output_tokens`` 0."""
    return {"object": "decision", "model": model,
            "answers": [answer(q, r) for q, r in zip(questions, reads, strict=True)],
            "usage": {"input_tokens": input_tokens,
                      "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
                      "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": input_tokens}}


async def decide(body: dict, model: str, reader_for) -> dict:
    """A whole request on one engine: parsed, its questions read by ``reader_for(priority)`` (the
    engine's ``Reader``), answered. Raises TandemError (400s name the field)."""
    req = parse(body)
    reader: Reader = reader_for(req.priority)
    if req.input_images and not reader.sees:
        raise invalid(f"input: model {model!r} does not take images", param="input")
    reads = await read_labels(reader, [Ask(q.messages, q.labels, q.images) for q in req.questions], None)
    return decision(body.get("model") or model, req.questions, [Read(r.probs, r.label_mass, r.refusal) for r in reads],
                    sum(r.input_tokens for r in reads), sum(r.cached_tokens for r in reads))
