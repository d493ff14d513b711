"""A second model family through the real diffusion engine (intake, scheduler, loop, runner,
chunks), registered from the test package alone: ``tests/toy_family.py`` implements
``diffusion_plugin.family.Family`` and nothing outside it changes."""

import asyncio

import pytest

from diffusion_plugin import families
from diffusion_plugin.engine import DiffusionEngine
from workers import tiny_models


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(families.ADAPTERS, "toy", "tests.toy_family:ToyAdapter")
    return str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))  # (its tokenizer)


def test_a_family_registered_from_the_tests_serves_chat_and_completions(toy):
    async def main():
        engine = DiffusionEngine("toy", toy, {"family": "toy", "sampler": "exact", "max_batch": 2})
        await engine.start()
        try:
            chat = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "seed": 3,
                    "logprobs": True, "top_logprobs": 2}
            completion = {"model": "toy", "prompt": "once upon", "max_tokens": 12, "seed": 4}

            async def last(gen):
                return [item async for item in gen][-1]

            together = await asyncio.gather(last(engine.chat(chat, "a")), last(engine.completions(completion, "b")),
                                            last(engine.chat({**chat, "stream": True}, "c")))
            alone = await last(engine.chat(chat, "d"))
        finally:
            await engine.shutdown()
        return together, alone

    (chat, completion, _), alone = asyncio.run(main())
    assert chat["object"] == "chat.completion" and completion["object"] == "text_completion"
    assert 0 < chat["usage"]["completion_tokens"] <= 20 and 0 < completion["usage"]["completion_tokens"] <= 12
    assert chat["choices"][0]["finish_reason"] in ("stop", "length")
    assert chat["choices"][0]["logprobs"]["content"], "top logprobs served through the family's pass"
    assert alone["choices"][0]["message"] == chat["choices"][0]["message"]  # exact mode: a row's own draws
