"""`python -m tandem_tools.bench.parsing`: what vLLM's tool and reasoning parsers cost a diffusion
choice, per committed block, at the real canvas (256 tokens a block).

No model: the cost is the text's, not the step's. A Gemma 4 answer (a thinking channel, text and
tool calls, repeated to ``--tokens`` tokens with the built-in tokenizer, whose Gemma 4 markers are
special tokens) is committed ``--canvas`` tokens at a time, in interleaved rounds, three ways:

- ``plain``: ``ChoiceText`` as for a model without parsers (special tokens skipped);
- ``raw``: ``ChoiceText`` in raw mode (special tokens kept, whole tokens released with their ids);
- ``parsed``: raw mode plus vLLM's ``gemma4`` parser's ``parse_delta`` per block and ``parse`` of
  the whole answer (what a streamed and a whole chat answer each pay).

Reported: CPU ms per block and per 1,000 tokens (this process's CPU time, the figure the box
reproduces best), and the ratios to ``plain``. Compare a block's cost with a denoise step at the
real shape (``docs/benchmarks.md``: tens of ms a step on this CPU, several steps a block).
"""

from __future__ import annotations

import argparse
import statistics
import time

UNIT = ('<|channel>thought\nThe user wants the weather, so I call the tool for each city.<channel|>'
        'Let me check both cities for you.'
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,detail:{wind:true,unit:<|"|>C<|"|>}}<tool_call|>'
        '<|tool_call>call:get_weather{city:<|"|>Tokyo<|"|>,days:5,detail:{wind:false,unit:<|"|>F<|"|>}}<tool_call|>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "detail": {"type": "object"}}}}}]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="answer length in tokens (default 4096)")
    ap.add_argument("--canvas", type=int, default=256, help="tokens per committed block (default 256: DiffusionGemma)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians reported (default 5)")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from diffusion_plugin.api.chunks import ChoiceText
    from diffusion_plugin.api.parsing import Parsers
    from workers import tiny_models

    tok = AutoTokenizer.from_pretrained(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))
    unit = tok(UNIT, add_special_tokens=False).input_ids
    ids = (unit * (args.tokens // len(unit) + 1))[:args.tokens]
    blocks = [ids[b:b + args.canvas] for b in range(0, len(ids), args.canvas)]
    parsers = Parsers(tok, "gemma4", "gemma4")
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    parsing = parsers.for_request(body, "chat", [1, 2, 3])

    def plain() -> None:
        text = ChoiceText(tok, [])
        for block in blocks:
            text.add(block)
        text.flush()

    def raw() -> None:
        text = ChoiceText(tok, [], raw=True)
        for block in blocks:
            text.add(block)
        text.flush()

    def parsed() -> int:
        text, choice, got, calls = ChoiceText(tok, [], raw=True), parsing.choice(), [], 0
        for block in blocks:
            out = text.add(block)
            got += out.ids
            calls += len(choice.add(out.text, out.ids, finished=False).get("tool_calls", []))
        rest = text.flush()
        choice.add(rest.text, rest.ids, finished=True)
        _, _, whole = choice.whole(tok.decode(ids, skip_special_tokens=False), ids)
        return len(whole)

    calls = parsed()
    ends = ids.count(tok.convert_tokens_to_ids("<tool_call|>"))
    assert calls >= ends > 0, (calls, ends)  # every finished call parsed (one cut at the end may count too)
    runs = {"plain": plain, "raw": raw, "parsed": parsed}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            t = time.process_time()
            fn()
            cpu[name].append(time.process_time() - t)
    base = statistics.median(cpu["plain"])
    print(f"{len(ids)} tokens in {len(blocks)} blocks of {args.canvas}; medians of {args.rounds} interleaved rounds")
    print(f"{'':8} {'CPU ms/block':>12} {'CPU ms/1k tok':>14} {'x plain':>8}")
    for name in runs:
        m = statistics.median(cpu[name])
        print(f"{name:8} {1e3 * m / len(blocks):12.2f} {1e6 * m / len(ids):14.2f} {m / base:8.2f}")


if __name__ == "__main__":
    main()
