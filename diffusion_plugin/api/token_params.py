"""The bodies of the tokenize routes (``/tokenize``, ``/detokenize``) on a diffusion model, as
vLLM's TokenizeRequest and DetokenizeRequest read them; parsed by ``params.parse``."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class TokenizeBody(BaseModel):
    """vLLM's TokenizeRequest (completion or chat form) minus tools and custom chat templates."""

    model_config = ConfigDict(extra="allow")
    IGNORES_EXTRA: ClassVar[bool] = True  # as vLLM's tokenize routes (``params.parse``)

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _defaults(self):
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in \
                self.model_fields_set:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        if self.continue_final_message:
            self.add_generation_prompt = False
        if self.add_special_tokens is None:
            self.add_special_tokens = self.messages is None
        return self


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    IGNORES_EXTRA: ClassVar[bool] = True  # as vLLM's tokenize routes (``params.parse``)

    model: str | None = None
    tokens: list[int] = Field()

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v):
        for t in v:
            if t < 0:
                raise ValueError("Input should be greater than or equal to 0")
            if t > 2**63 - 1:
                raise ValueError("Input should be less than or equal to 9223372036854775807")
        return v
