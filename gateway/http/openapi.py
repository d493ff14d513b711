"""The request bodies of the OpenAI routes, as JSON Schema for tandem's OpenAPI document.

The routes take the raw body (validation is the engines': vLLM's own models, the diffusion
engine's), so FastAPI cannot infer these; they are declared here for clients, docs and the
schema-driven fuzz tests. Bounds follow the OpenAI API and tandem's own limits, so a request
that fits the schema is one tandem should answer without a 5xx.
"""

from __future__ import annotations

from diffusion_plugin.api.params import knobs_schema
from tandem_core import decisions
from tandem_core.config import LimitsConfig

_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_IMAGE_PART = {"type": "object", "required": ["type", "image_url"],
               "description": "An image (models with vision input): a data:image/...;base64 URL, or http(s) where "
                              "the deployment fetches images.",
               "properties": {"type": {"const": "image_url"},
                              "image_url": {"type": "object", "required": ["url"],
                                            "properties": {"url": {"type": "string"}}}}}
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": {"anyOf": [{"type": "string"},
                              {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}, "minItems": 1}]},
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
    },
}
_STOP = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1},
                                                          "maxItems": 4}, {"type": "null"}]}
# The diffusion engine's own request schema (generated from ``DiffusionKnobs``), so the document
# cannot drift from what the engine validates. Imported directly, not through
# ``workers.registry``: ``diffusion_plugin.api.params`` imports no torch (a test checks), and a static
# import is one the layering test sees.
_DIFFUSION = knobs_schema()


def request_body_schema(route: str, models: list[str], limits: LimitsConfig) -> dict:
    """``openapi_extra`` for one generation route: its JSON request body."""
    max_tokens = {"type": ["integer", "null"], "minimum": 1}
    if limits.max_tokens_ceiling is not None:
        max_tokens["maximum"] = limits.max_tokens_ceiling
    n = {"type": ["integer", "null"], "minimum": 1}
    if limits.max_n is not None:
        n["maximum"] = limits.max_n
    common = {
        "model": {"enum": models, "description": "A configured model (GET /v1/models)."},
        "max_tokens": max_tokens,
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "n": n,
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
        "stop": _STOP,
        "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1},
        "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
        "user": {"type": "string", "maxLength": 256},
        "diffusion": _DIFFUSION,
    }
    if route not in ("chat", "completions"):
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": _other_schema(route, models, max_tokens)}}}}
    if route == "chat":
        props = {**common, "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
                 "max_completion_tokens": max_tokens,
                 "logprobs": {"type": ["boolean", "null"]},
                 "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20}}
        required = ["model", "messages"]
    else:
        props = {**common, "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                                                {"type": "array", "items": {"type": "string", "minLength": 1},
                                                 "minItems": 1, "maxItems": 8}]},
                 "echo": {"type": ["boolean", "null"]},
                 "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}}
        required = ["model", "prompt"]
    schema = {"type": "object", "required": required, "properties": props}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_ANTHROPIC_MESSAGE = {"type": "object", "required": ["role", "content"],
                      "properties": {"role": {"enum": ["user", "assistant"]},
                                     "content": {"anyOf": [{"type": "string"},
                                                           {"type": "array", "items": _TEXT_PART, "minItems": 1}]}}}


def _other_schema(route: str, models: list[str], max_tokens: dict) -> dict:
    """The bodies of the routes vLLM serves besides chat and completions (its own request
    models validate them in the replica; these are what clients need to know)."""
    model = {"enum": models, "description": "A configured model (GET /v1/models)."}
    if route == "responses":
        props = {"model": model, "input": {"anyOf": [{"type": "string", "minLength": 1},
                                                     {"type": "array", "items": {"type": "object"}, "minItems": 1}]},
                 "instructions": {"type": ["string", "null"]}, "max_output_tokens": max_tokens,
                 "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
                 "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
                 "stream": {"type": ["boolean", "null"]}, "store": {"type": ["boolean", "null"]},
                 "previous_response_id": {"type": ["string", "null"]},
                 "diffusion": _DIFFUSION}
        required = ["model", "input"]
    elif route in ("messages", "messages_count_tokens"):
        props = {"model": model, "messages": {"type": "array", "items": _ANTHROPIC_MESSAGE, "minItems": 1},
                 "system": {"type": "string"}}
        required = ["model", "messages"]
        if route == "messages":
            props.update(max_tokens={**max_tokens, "type": "integer"}, stream={"type": "boolean"},
                         temperature={"type": "number", "minimum": 0, "maximum": 1})
            required.append("max_tokens")
    elif route == "tokenize":
        props = {"model": model, "prompt": {"type": "string"}, "messages": {"type": "array", "items": _MESSAGE},
                 "add_special_tokens": {"type": "boolean"}}
        return {"type": "object", "required": ["model"], "properties": props,
                "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
    elif route == "detokenize":
        props = {"model": model, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}
        required = ["model", "tokens"]
    elif route in ("embeddings", "pooling", "classify"):
        ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
        props = {"model": model, "input": {"anyOf": [
            {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1},
                                                 "minItems": 1}, ids, {"type": "array", "items": ids, "minItems": 1}]},
            "user": {"type": "string", "maxLength": 256}}
        if route == "embeddings":
            props.update(encoding_format={"enum": ["float", "base64"]},
                         dimensions={"type": ["integer", "null"], "minimum": 1})
        required = ["model", "input"]
    elif route in ("score", "score_v1"):
        text = {"anyOf": [{"type": "string", "minLength": 1},
                          {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}]}
        props = {"model": model, "text_1": text, "text_2": text}
        required = ["model", "text_1", "text_2"]
    elif route in ("rerank", "rerank_v1"):
        props = {"model": model, "query": {"type": "string", "minLength": 1},
                 "documents": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                 "top_n": {"type": "integer", "minimum": 0}}
        required = ["model", "query", "documents"]
    elif route == "decisions":
        schema = decisions_schema()
        schema["properties"]["model"] = model
        return schema
    elif route == "systemone":
        props = {"model": model, "state": {}, "instructions": {"type": ["string", "null"]},
                 "questions": {"type": "object", "minProperties": 1, "maxProperties": 64, "additionalProperties": {
                     "type": "object", "required": ["type"],
                     "properties": {"type": {"enum": ["noul", "choice", "score"]}, "instructions": {"type": "string"},
                                    "criteria": {}}}}}
        required = ["model", "state", "questions"]
    else:
        raise ValueError(f"no request schema for route {route!r}")
    return {"type": "object", "required": required, "properties": props}


def decisions_schema() -> dict:
    """``/v1/decisions``' body, generated from the models ``tandem_core.decisions.parse`` reads it
    with (the request, its input items and questions by type), every reference inlined."""
    def typed(models) -> list[dict]:
        return [_inlined(m.model_json_schema()) for m in models]

    schema = _inlined(decisions.DecisionRequest.model_json_schema())
    props = schema["properties"]
    props["input"] = {"anyOf": [{"type": "string"},
                                {"type": "array", "items": {"anyOf": typed(decisions.ITEMS.values())}}]}
    props["questions"]["items"] = {"oneOf": typed(decisions.QUESTIONS.values())}
    return schema


def _inlined(schema: dict) -> dict:
    defs = schema.pop("$defs", {})

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(defs[node["$ref"].rsplit("/", 1)[1]])
            return {k: walk(v) for k, v in node.items() if k != "discriminator"}  # its mapping names $defs
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node
    return walk(schema)
