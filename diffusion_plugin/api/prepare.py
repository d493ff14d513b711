"""One request on the way in: ``Preparer.prepare`` turns a chat, completions or Responses body
into a typed ``Prepared``, the same way for every route, before anything is queued.

The steps, in order (each raises ``TandemError``, a 400 naming the field):
1. the route's body model (``params.ChatBody``, ``params.CompletionBody``,
   ``responses.ResponsesBody``): each field alone, and the rules within one field group;
2. the structured output (``structured.resolve``, vLLM's request models) and its compiled
   grammar (xgrammar, one compiler per engine, made at the first constrained request);
3. the prompt and the effective knobs (``intake.Intake``: chat template, images, the context
   length and the memory budget);
4. the rules across those parts (``_across``): what a grammar cannot be served with;
5. the model's parsers (``parsing.Parsers``: tool calls for ``tool_choice`` "auto", reasoning), on
   the routes that carry what they parse (chat, Responses); completions are answered as the model
   wrote them, as ``vllm serve`` answers them with the same parser flags.

A ``Prepared`` is not changed afterwards: the engine builds its sequences from ``request`` and
the route's writer (``chunks.openai_items``, ``responses.serve_responses``) reads ``body``,
``structured`` and ``parsing``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from diffusion_plugin.api import params as P
from diffusion_plugin.api.intake import Intake, SeqRequest
from diffusion_plugin.api.parsing import Parsers
from diffusion_plugin.api.responses import NEUTRAL, ResponsesBody, chat_tools, to_messages
from diffusion_plugin.api.structured import Structured, request_errors, resolve, wanted
from tandem_core.errors import invalid


@dataclass(frozen=True)
class Route:
    """One generation route's way in: its body model, the extra fields it accepts as neutral
    (``params.refuse_unsupported``), the intake call that makes its ``SeqRequest``, and whether
    the model's parsers read its output (``parsed``: tools and reasoning exist on the route)."""

    body: type[BaseModel]
    neutral: dict[str, tuple] | None
    intake: Callable[[Intake, Any], Awaitable[SeqRequest]]
    parsed: bool


ROUTES: dict[str, Route] = {
    "chat": Route(P.ChatBody, None, Intake.chat, parsed=True),
    "completions": Route(P.CompletionBody, None, Intake.completion, parsed=False),  # vLLM parses no completion
    "responses": Route(ResponsesBody, NEUTRAL,
                       lambda intake, req: intake.responses(req, to_messages(req), chat_tools(req.tools)), parsed=True),
}


@dataclass(frozen=True)
class Prepared:
    """A request ready to run: its route's validated body, the batcher's request, and its
    output specs (a structured output, the model's parsers)."""

    route: str  # one of ROUTES
    body: BaseModel  # the route's body model
    request: SeqRequest  # what the batcher's sequences are built from
    structured: Structured | None  # a structured output (tool calls included), or None
    parsing: Any | None  # ``parsing.Parsing`` for the model's parsers, or None


class Preparer:
    """Owns the grammar compiler (one per engine) and prepares every generation route's requests."""

    def __init__(self, adapter, intake: Intake, parsers: Parsers):
        self.adapter, self.intake, self.parsers = adapter, intake, parsers
        self._compiler = None  # grammar.GrammarCompiler, made at the first structured output
        self._compiler_lock = threading.Lock()

    async def prepare(self, body: dict, route: str) -> Prepared:
        """``body`` of ``route`` (one of ``ROUTES``) as a ``Prepared``. Raises ``TandemError``."""
        way = ROUTES[route]
        req = P.parse(way.body, body, way.neutral)
        structured, grammar = await self._constraint(body, route)
        sreq = await way.intake(self.intake, req)
        _across(sreq, grammar)
        parsing = await self._parsing(body, route, structured, sreq)
        sreq = replace(sreq, grammar=grammar, output=replace(sreq.output, raw_text=parsing is not None))
        return Prepared(route, req, sreq, structured, parsing)

    async def _constraint(self, body: dict, route: str) -> tuple[Structured | None, object | None]:
        """The request's structured output (``diffusion_plugin.api.structured``) and its compiled
        grammar, or (None, None)."""
        if not wanted(body):
            return None, None
        if body.get("tools") and body.get("tool_choice") in (None, "auto") and not self.parsers.auto_tools:
            raise invalid('"auto" tool choice needs the model\'s tool parser (engine_args.tool_call_parser), '
                          'which this diffusion model has not set; use tool_choice "required", a named '
                          'function or "none"', param="tool_choice")
        structured = await asyncio.to_thread(resolve, body, route)
        if structured is None:
            return None, None
        return structured, await asyncio.to_thread(self._compile, structured)

    async def _parsing(self, body: dict, route: str, structured: Structured | None, sreq: SeqRequest):
        """The request's parsing by the model's parsers (``diffusion_plugin.api.parsing``), or None: none
        configured, a route without tools or reasoning (completions), or the output is constrained
        tool calls (``tool_choice`` required or named)."""
        if not (self.parsers.configured and ROUTES[route].parsed) or (structured is not None and structured.tool_mode):
            return None
        with request_errors(body):
            return await asyncio.to_thread(self.parsers.for_request, body, route, sreq.prompt.ids)

    def _compile(self, structured: Structured):
        from diffusion_plugin.step.grammar import GrammarCompiler

        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.adapter.tokenizer, self.adapter.vocab_size,
                                                 self.adapter.eos_token_ids)
        try:
            return self._compiler.compile(structured.kind, structured.spec)
        except Exception as e:  # noqa: BLE001 - xgrammar's refusal of the client's spec
            raise invalid(f"{structured.param}: the grammar cannot be compiled: {e}", param=structured.param) from None


def _across(sreq: SeqRequest, grammar) -> None:
    """The rules across a request's parts, on every route. A grammar decides every token, so a
    seed canvas or a ``min_tokens`` would be overridden (or unsatisfiable): refused."""
    if grammar is None:
        return
    clash = next((f for f in ("seed_canvas", "min_tokens") if getattr(sreq.params, f)), None)
    if clash is not None:
        param = "diffusion.seed_canvas" if clash == "seed_canvas" else clash
        raise invalid(f"{param}: not served with a structured output on diffusion models (the grammar decides "
                      f"every token)", param=param)
