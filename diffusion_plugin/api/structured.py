"""Structured outputs and forced tool calls on a diffusion model, meaning what they mean on vLLM.

A request's constraint is read with vLLM's own request models and helpers, so one request means
the same on both model kinds:

- chat and completions: ``response_format`` (``json_schema``, strict or not, and
  ``json_object``) and vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
  ``grammar``, ``structural_tag``), through the request model's ``extract_structured_outputs``;
- Responses: ``text.format`` (``json_schema``, ``json_object``);
- chat and Responses: ``tools`` with ``tool_choice: "required"`` or a named function: vLLM's
  tool-call JSON schema (``get_json_schema_from_tools``, the one vLLM constrains its AR models
  with: an array of ``{"name", "parameters"}``, or the named function's parameters).

vLLM's ``validate_xgrammar_grammar`` refuses what xgrammar cannot compile (a 400 naming the
field, as on ``vllm serve``) and turns ``choice`` into a grammar; vLLM's key gives the
(kind, spec) that ``grammar.GrammarCompiler`` compiles over the model's tokenizer. (vLLM's own
native DiffusionGemma refuses structured outputs with a 400; tandem serves them.)

Imports vLLM (and so torch) when first used, in the replica, never in the gateway.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tandem_core.errors import invalid

_FIELDS = ("response_format", "structured_outputs", "tools", "tool_choice", "text")
_PARSING = ("include_reasoning", "chat_template_kwargs", "reasoning")  # what vLLM's parsers also read


@dataclass
class Structured:
    """A request's constraint: the spec to compile, and how its output is answered."""

    kind: str  # grammar.GrammarCompiler's kinds
    spec: str
    param: str  # the request field it came from (a 400 names it)
    tool_mode: str | None = None  # "required" or "named": the output is tool calls
    tool_name: str | None = None  # named: the function


def warm_structured() -> None:
    """Import what ``resolve`` and the grammar use (seconds: vLLM imports torch and more)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: F401
    from vllm.tool_parsers.utils import get_json_schema_from_tools  # noqa: F401
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar  # noqa: F401

    import diffusion_plugin.step.grammar  # noqa: F401


def wanted(body: dict) -> bool:
    """Whether ``body`` may carry a constraint (cheap: no vLLM import otherwise)."""
    return any(body.get(f) not in (None, [], {}) for f in _FIELDS)


def resolve(body: dict, route: str) -> Structured | None:
    """The constraint of a chat, completions or responses body, or None. Raises ``TandemError``
    (400) for what vLLM refuses."""
    if not wanted(body):
        return None
    with request_errors(body):
        return _resolve(body, route)


@contextmanager
def request_errors(body: dict):
    """vLLM's refusals of a request (its request models, helpers and validators) as 400s naming the
    field: the one place they are translated."""
    from pydantic import ValidationError
    from vllm.exceptions import VLLMValidationError

    try:
        yield
    except VLLMValidationError as e:
        raise invalid(str(e), param=getattr(e, "parameter", None) or _guess_param(body)) from None
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise invalid(f"{loc}: {first['msg']}", param=loc.split(".")[0] or None) from None
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # vLLM's helpers on a malformed field
        raise invalid(f"{_guess_param(body)}: {e}", param=_guess_param(body)) from None


def vllm_request(body: dict, route: str):
    """vLLM's request model of a chat or Responses body: the fields its parsers read."""
    return _model(route).model_validate(_vllm_body(body, route, _PARSING))


def _resolve(body: dict, route: str) -> Structured | None:
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.tool_parsers.utils import get_json_schema_from_tools
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar
    from vllm.v1.structured_output.request import get_structured_output_key

    req = _model(route).model_validate(_vllm_body(body, route, ()))
    tool_mode = tool_name = None
    choice = getattr(req, "tool_choice", None)
    tools = getattr(req, "tools", None)
    if tools and choice not in (None, "none", "auto"):
        schema = get_json_schema_from_tools(choice, tools, getattr(req, "parallel_tool_calls", None))
        so, param = StructuredOutputsParams(json=schema), "tools"
        tool_mode = "required" if choice == "required" else "named"
        tool_name = None if choice == "required" else _tool_name(choice)
    else:
        so = req.extract_structured_outputs()
        if body.get("structured_outputs") is not None:
            param = "structured_outputs"
        else:
            param = "text" if route == "responses" else "response_format"
    if so is None:
        return None
    sp = SamplingParams(structured_outputs=so)
    validate_xgrammar_grammar(sp)  # vLLM's refusals; choice -> grammar
    option, spec = get_structured_output_key(sp.structured_outputs)
    return Structured(_KINDS[option.name], spec, param, tool_mode, tool_name)


def _guess_param(body: dict) -> str | None:
    return next((f for f in _FIELDS if body.get(f) not in (None, [], {})), None)


def _tool_name(choice: Any) -> str:
    fn = getattr(choice, "function", None)
    return fn.name if fn is not None else choice.name


_KINDS = {"JSON": "json", "JSON_OBJECT": "json_object", "REGEX": "regex", "GRAMMAR": "grammar",
          "STRUCTURAL_TAG": "structural_tag"}


def _model(route: str):
    if route == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest
    if route == "completions":
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    return ResponsesRequest


def _vllm_body(body: dict, route: str, more: tuple[str, ...]) -> dict:
    """The fields vLLM's request model reads for a constraint (and ``more``; tandem's own extension
    fields, such as ``diffusion``, are not vLLM's)."""
    keep = {"model", "messages", "prompt", "input", "instructions", "parallel_tool_calls", *_FIELDS, *more}
    out = {k: v for k, v in body.items() if k in keep}
    if route == "chat":
        out.setdefault("messages", [{"role": "user", "content": ""}])
    elif route == "completions":
        out.setdefault("prompt", "")
    else:
        out.setdefault("input", "")
    return out


def tool_calls_from_text(text: str, structured: Structured) -> list[dict]:
    """A finished constrained output as OpenAI ``tool_calls``, as vLLM's parser answers them: the
    required array's elements (arguments re-serialised), or the named function with the text as
    its arguments."""
    from vllm.renderers.chat_utils import make_tool_call_id

    if structured.tool_mode == "named":
        if not text.strip():
            return []
        calls = [(structured.tool_name, text)]
    else:
        try:
            items = json.loads(text)
        except ValueError:
            items = []  # cut by max_tokens: no complete call (vLLM answers none either)
        calls = [(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
                 for c in items if isinstance(c, dict) and isinstance(c.get("name"), str)]
    return [{"id": make_tool_call_id(), "type": "function", "function": {"name": name, "arguments": args}}
            for name, args in calls]


class ToolCallStream:
    """One choice's streamed tool calls: each committed block's text -> OpenAI ``tool_calls``
    delta entries, with vLLM's streaming helpers over the accumulated text (a block may hold
    several call boundaries, or half of one)."""

    def __init__(self, structured: Structured):
        self.structured = structured
        self.text = ""
        self.named_started = False
        self.any = False

    def add(self, delta: str) -> list[dict]:
        from vllm.tool_parsers.streaming import (
            extract_named_tool_call_streaming,
            extract_required_tool_call_streaming,
        )

        previous, self.text = self.text, self.text + delta
        if not delta:
            return []
        if self.structured.tool_mode == "named":
            message, self.named_started = extract_named_tool_call_streaming(
                delta_text=delta, function_name=self.structured.tool_name, function_name_returned=self.named_started,
                tool_call_idx=None, tool_call_id_type="random", tokenizer=None)
        else:
            message, _ = extract_required_tool_call_streaming(
                previous_text=previous, current_text=self.text, tool_call_idx=None, tool_call_id_type="random")
        if message is None or not message.tool_calls:
            return []
        self.any = True
        return [tc.model_dump(exclude_none=True) for tc in message.tool_calls]

