"""``tool_choice: "auto"`` and reasoning on a diffusion model: vLLM's own parsers over committed blocks.

``engine_args.tool_call_parser`` and ``reasoning_parser`` take vLLM's parser names (``gemma4``
for DiffusionGemma). ``Parsers`` resolves them once, at engine start, to vLLM's composed parser
class (``ParserManager.get_parser``, checked against the model's tokenizer as ``vllm serve``
checks it), so a name vLLM does not know fails the replica's start. Each choice of a chat or
Responses request then holds one instance, as vLLM's serving layer does:

- **Streamed**: each committed block is one ``parse_delta``: the text of whole tokens decoded
  with special tokens kept (Gemma 4's markers are special tokens, and vLLM's parser finds them
  by id) with the ids of exactly those tokens (``chunks.ChoiceText`` releases whole tokens when a
  parser reads them). A block is a burst of tokens, so one delta may hold several tool-call
  boundaries, or half of one; vLLM's streaming parser keeps its state across deltas, which is
  what its own diffusion fixes (vllm#45413) rely on.
- **Whole**: ``parse`` over the choice's whole text and ids, with a fresh instance.

``tool_choice`` ``"required"`` and named functions do not come here: they are constrained to
vLLM's tool-call JSON (``structured``). With ``tool_choice: "none"`` vLLM's parser makes no tool
calls (a call the model writes anyway is dropped, as on ``vllm serve``); ``include_reasoning:
false`` drops the reasoning. The parsers read the template's kwargs as the chat template does
(``params.template_kwargs``: ``reasoning_effort`` switches Gemma 4's thinking, as on vLLM). Completions
are not parsed (``prepare.ROUTES``), as ``vllm serve`` parses none with the same flags.

Imports vLLM when first used, in the replica, never in the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem_core.errors import ErrorKind, TandemError


class Parsers:
    """A model's configured parsers: vLLM's composed class, or none."""

    def __init__(self, tokenizer, tool_call_parser: str | None, reasoning_parser: str | None):
        self.tokenizer = tokenizer
        self.auto_tools = tool_call_parser is not None
        self.cls = None
        if tool_call_parser is None and reasoning_parser is None:
            return
        from vllm.parser.parser_manager import ParserManager

        try:
            self.cls = ParserManager.get_parser(tool_parser_name=tool_call_parser,
                                                reasoning_parser_name=reasoning_parser,
                                                enable_auto_tools=self.auto_tools, tokenizer=tokenizer)
        except (TypeError, KeyError, ValueError) as e:
            field = "tool_call_parser" if tool_call_parser and str(tool_call_parser) in str(e) else (
                "reasoning_parser" if reasoning_parser else "tool_call_parser")
            raise ValueError(f"engine_args.{field}: {e}") from None

    @property
    def configured(self) -> bool:
        return self.cls is not None

    def for_request(self, body: dict, route: str, prompt_ids: list[int]) -> Parsing | None:
        """The parsing of a chat or Responses request (None: its text is answered as is)."""
        if self.cls is None:
            return None
        from diffusion_plugin.api.params import template_kwargs
        from diffusion_plugin.api.structured import vllm_request

        request = vllm_request(body, route)
        kwargs = template_kwargs(body.get("reasoning_effort") if route == "chat" else None,
                                 getattr(request, "chat_template_kwargs", None)) or {}
        return Parsing(self.cls, request, self.tokenizer, list(prompt_ids), self.auto_tools, kwargs)


@dataclass
class Parsing:
    """One request's parsing: what its choices' parsers share."""

    cls: type
    request: Any  # vLLM's ChatCompletionRequest or ResponsesRequest
    tokenizer: Any
    prompt_ids: list[int]
    auto_tools: bool
    chat_template_kwargs: dict

    def new(self):
        return self.cls(self.tokenizer, self.request.tools, chat_template_kwargs=self.chat_template_kwargs)

    def choice(self) -> ChoiceParser:
        return ChoiceParser(self)


class ChoiceParser:
    """One choice's parse: committed blocks -> OpenAI delta fields, and the whole answer."""

    def __init__(self, parsing: Parsing):
        self.parsing = parsing
        self.parser = parsing.new()
        self.tools_called = False

    def add(self, text: str, ids: list[int], finished: bool) -> dict:
        """A committed block's delta fields (``content``, ``reasoning``, ``tool_calls``), as vLLM
        streams them ({} when the block gave none)."""
        if not text and not ids and not finished:
            return {}
        p = self.parsing
        try:
            message = self.parser.parse_delta(text, list(ids), p.request, prompt_token_ids=p.prompt_ids,
                                              finished=finished)
        except Exception as e:  # noqa: BLE001 - vLLM's parser on text it cannot read: the request's error
            raise _unparsable(e) from None
        if message is None:
            return {}
        out = message.model_dump(exclude_none=True)
        out.pop("role", None)
        if out.get("tool_calls"):
            self.tools_called = True
            out["tool_calls"] = [_plain(tc) for tc in out["tool_calls"]]
        return {k: v for k, v in out.items() if v not in ("", [], None) or k == "content" and v == ""}

    def whole(self, text: str, ids: list[int]) -> tuple[str | None, str | None, list[dict]]:
        """(reasoning, content, tool_calls) of the whole answer, as vLLM's non-streamed answer."""
        from vllm.renderers.chat_utils import make_tool_call_id

        p = self.parsing
        parser = p.new()
        parser.set_prompt_token_ids(p.prompt_ids)
        try:
            reasoning, content, calls = parser.parse(text, p.request, enable_auto_tools=p.auto_tools,
                                                     model_output_token_ids=list(ids))
        except Exception as e:  # noqa: BLE001 - as in ``add``
            raise _unparsable(e) from None
        if not getattr(p.request, "include_reasoning", True):
            reasoning = None
        tool_calls = [{"id": c.id or make_tool_call_id(), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}} for c in calls or []]
        self.tools_called = self.tools_called or bool(tool_calls)
        return reasoning, content, tool_calls


def _unparsable(e: Exception) -> TandemError:
    return TandemError(ErrorKind.ENGINE_ERROR, f"the model's parser failed on its output: {type(e).__name__}: {e}")


def _plain(tc: dict) -> dict:
    """A streamed tool-call entry without vLLM's empty fields (a continuation carries only its
    ``index`` and ``function.arguments``; the first entry of a call ``id``, ``type``, ``name``)."""
    fn = {k: v for k, v in (tc.get("function") or {}).items() if v is not None}
    out = {k: v for k, v in tc.items() if k != "function" and v is not None}
    if fn:
        out["function"] = fn
    return out
