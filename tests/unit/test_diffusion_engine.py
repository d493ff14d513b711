"""``DiffusionEngine`` end to end on CPU without torch: a character tokenizer, a model adapter
double and a runner double that produces hand-built step outputs (two steps per block, a
preview on the first, the block ``"tok "`` on the second) drive the real intake, scheduler,
loop and chunk building."""

import asyncio
import json
import threading

import pytest

from diffusion_plugin.api.chunks import ChoiceText
from diffusion_plugin.batcher.batch import RowOutput, StepOutput
from diffusion_plugin.engine import DiffusionEngine
from tandem_core.errors import ErrorKind, TandemError
from tandem_core.protocol import DONE
from tests.waiting import async_wait_for

EOS = 1
CANVAS = 4
BLOCK = [ord(c) for c in "tok "]


class CharTokenizer:
    """One token per character (its code point); id 1 is the special end-of-sequence token."""

    def __call__(self, text, add_special_tokens=True):
        return type("Encoded", (), {"input_ids": [ord(c) for c in text]})()

    def __len__(self):
        return 0x110000

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, return_dict=False, **_):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " * add_generation_prompt)
        return [ord(c) for c in text] if tokenize else text

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<eos>" if i == EOS else chr(i) for i in ids if not (skip_special_tokens and i == EOS))

    def convert_ids_to_tokens(self, ids):
        return [self.decode([i]) for i in ids]


class FakeAdapter:
    tokenizer = CharTokenizer()
    canvas_length = CANVAS
    max_position = 10**9
    eos_token_ids = (EOS,)
    has_vision = False

    def defaults(self):
        return {"max_denoising_steps": 2, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8,
                "stability_threshold": 1, "confidence_threshold": 0.005}


class FakeRunner:
    """``execute`` in the loop's worker thread: each row commits ``BLOCK`` at its second step of
    a block (a preview of it at the first). ``fail``: every forward raises."""

    def __init__(self, fail=False):
        self.fail = fail
        self.freed: list[str] = []
        self.resets = 0
        self.steps = 0
        self.lock = threading.Lock()

    def execute(self, batch, seqs):
        with self.lock:
            self.steps += 1
        if self.fail:
            raise RuntimeError("the forward exploded")
        rows = []
        for sid in batch.denoise:
            done = seqs[sid].step + 1 >= 2
            rows.append(RowOutput(sid, done, committed=BLOCK if done else None,
                                  preview=BLOCK if seqs[sid].params.previews else None))
        return StepOutput(rows=rows)

    def free(self, seq_id):
        self.freed.append(seq_id)

    def reset(self):
        self.resets += 1


def run(test, runner=None, **engine_args):
    """``test(engine, runner)`` inside an event loop, on a started engine."""
    async def main():
        engine = DiffusionEngine("m", "unused", {"max_batch": 4, **engine_args})
        r = runner or FakeRunner()
        engine.start_with(FakeAdapter(), r, memory=None)
        try:
            return await test(engine, r)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


async def items(gen):
    return [x async for x in gen]


def payloads(chunks):
    return [json.loads(c[len("data: "):]) for c in chunks if isinstance(c, str) and c != DONE]


def test_a_streamed_request_sends_its_blocks_as_chunks_and_ends_with_done():
    async def test(engine, runner):
        return await items(engine.chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 8, "stream": True, "diffusion": {"previews": True},
                                        "stream_options": {"include_usage": True}}, "r"))

    out = run(test)
    assert out[-1] == DONE and not any(isinstance(x, TandemError) for x in out)
    chunks = payloads(out)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["delta"].get("content", "") for c in choices) == "tok tok "
    previews = [c["diffusion_preview"] for c in choices if "diffusion_preview" in c]
    assert [(p["block"], p["step"], p["text"]) for p in previews] == [(0, 1, "tok "), (1, 1, "tok ")]
    assert choices[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": len("user: hi\nassistant: "), "completion_tokens": 8,
                                   "total_tokens": len("user: hi\nassistant: ") + 8}


def test_a_whole_answer_with_n_choices_and_a_stop_string():
    async def test(engine, runner):
        whole = await items(engine.completions({"model": "m", "prompt": "x", "max_tokens": 12, "n": 2}, "a"))
        stopped = await items(engine.completions({"model": "m", "prompt": "x", "max_tokens": 12, "stop": "k"},
                                                 "b"))
        return whole, stopped, engine.loop

    (whole,), (stopped,), loop = run(test)
    assert [c["text"] for c in whole["choices"]] == ["tok tok tok "] * 2
    assert [c["finish_reason"] for c in whole["choices"]] == ["length", "length"]
    assert whole["usage"]["completion_tokens"] == 24
    assert stopped["choices"][0]["text"] == "to" and stopped["choices"][0]["finish_reason"] == "stop"
    assert not loop.seqs and not loop.scheduler.running


def test_abort_mid_stream_frees_its_row():
    async def test(engine, runner):
        gen = engine.chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**8,
                           "stream": True}, "r")
        seen = []
        async for item in gen:
            seen.append(item)
            if any(c["choices"][0].get("delta", {}).get("content") for c in payloads([item])):
                break  # the first block reached the client; now it leaves
        await gen.aclose()
        await async_wait_for(lambda: "r-0" in runner.freed, "the aborted sequence's row is freed")
        return seen, engine

    seen, engine = run(test)
    s = engine.loop.scheduler
    assert not s.running and not s.reserved and s.stats.aborted == 1
    assert not engine.loop.seqs and not engine._requests


def test_the_engine_abort_ends_the_request_with_finish_reason_abort():
    async def test(engine, runner):
        gen = engine.completions({"model": "m", "prompt": "x", "max_tokens": 10**8}, "r")
        task = asyncio.ensure_future(items(gen))
        await async_wait_for(lambda: engine.loop.scheduler.stats.blocks_committed > 0, "a block is committed")
        assert await engine.abort("r")
        return await task, runner

    (whole,), runner = run(test)
    assert whole["choices"][0]["finish_reason"] == "abort" and whole["choices"][0]["text"].startswith("tok ")
    assert "r-0" in runner.freed


def test_a_runner_failure_ends_every_affected_request_with_an_error():
    async def test(engine, runner):
        streamed = engine.chat({"model": "m", "messages": [{"role": "user", "content": "a"}], "stream": True,
                                "n": 2}, "s")
        whole = engine.completions({"model": "m", "prompt": "b"}, "w")
        out = await asyncio.gather(items(streamed), items(whole))
        runner.fail = False
        after = await items(engine.completions({"model": "m", "prompt": "c", "max_tokens": 4}, "c"))
        return out, after, runner

    (streamed, whole), after, runner = run(test, FakeRunner(fail=True))
    for out in (streamed, whole):
        err = out[-1]
        assert isinstance(err, TandemError) and err.kind is ErrorKind.ENGINE_ERROR, out
        assert "the forward exploded" in err.message
        assert DONE not in out
    assert runner.resets >= 1
    assert after[0]["choices"][0]["text"] == "tok "  # the loop serves on


@pytest.mark.parametrize("body, param", [
    ({"top_p": 1.5}, "top_p"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"diffusion": {"t_min": 500}}, "diffusion.t_min"),
    ({"diffusion": {"max_denoising_steps": 0}}, "diffusion.max_denoising_steps"),
    ({"diffusion": {"entropy_bnd": 1}}, "diffusion.entropy_bnd"),
    ({"n": 17}, "n"),
    ({"messages": []}, "messages"),
])
def test_a_bad_field_is_a_400_naming_it(body, param):
    async def test(engine, runner):
        base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        return await items(engine.chat({**base, **body}, "r")), runner

    out, runner = run(test)
    assert len(out) == 1 and isinstance(out[0], TandemError), out
    assert out[0].status == 400 and out[0].param == param, repr(out[0])
    assert runner.steps == 0  # refused before anything was queued


def test_a_bad_engine_arg_names_it():
    with pytest.raises(ValueError, match="engine_args.sampler"):
        DiffusionEngine("m", "unused", {"sampler": "fastest"})
    with pytest.raises(ValueError, match="engine_args.max_batchh"):
        DiffusionEngine("m", "unused", {"max_batchh": 4})



@pytest.mark.parametrize("blocks, stops, sent", [
    (["tok ", "abc"], ["k a"], "to"),  # the stop string spans two blocks: nothing of it leaves
    (["tok ", "abc"], ["k x"], "tok abc"),  # a held-back tail that was no stop is sent at the end
    (["ab", "cd", "ef"], ["bcde"], "a"),  # over three blocks
    (["abc", "def"], ["zz", "cd"], "ab"),
])
def test_a_stop_string_across_blocks_never_leaks(blocks, stops, sent):
    """Text already sent cannot be taken back: a tail that may begin a stop string waits for the
    next block (seen: "tok " sent, then the stop "k a" completed by the next block)."""
    tok = CharTokenizer()
    text = ChoiceText(tok, stops)
    out = "".join(text.add([ord(c) for c in b])[0] for b in blocks) + text.flush()[0]
    assert out == sent


class EosRunner(FakeRunner):
    """Commits ``"t"``, EOS, ``"k"``, ``" "`` every block."""

    def execute(self, batch, seqs):
        block = [ord("t"), EOS, ord("k"), ord(" ")]
        return StepOutput(rows=[RowOutput(sid, True, committed=block) for sid in batch.denoise])


def test_ignore_eos_goes_on_past_eos_until_max_tokens():
    async def test(engine, runner):
        body = {"model": "m", "prompt": "x", "max_tokens": 10}
        return (await items(engine.completions(body, "a")))[0], (await items(engine.completions(
            {**body, "ignore_eos": True}, "b")))[0]

    stopped, ignored = run(test, EosRunner())
    assert stopped["choices"][0]["text"] == "t" and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 1
    assert ignored["choices"][0]["text"] == "tk tk t" and ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["usage"]["completion_tokens"] == 10  # EOS counted as the ordinary token it is here
