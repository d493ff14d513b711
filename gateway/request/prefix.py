"""A prompt's prefix blocks: what the gateway knows of its prompt's cacheable prefix.

``routing: prefix`` (``gateway/routing/prefix_index.py``) sends a request to the replica likely
to hold the longest cached prefix of its prompt. The gateway cannot see token ids (it does not
tokenize), so it approximates vLLM's prefix cache on the prompt's text: ``prompt_blocks`` cuts the
text (chat messages in order, each message's role and text; or a completion's prompt) into blocks
of ``BLOCK_CHARS`` characters, about 64 tokens, and chains each block's hash with its
predecessor's, as vLLM chains its block hashes: equal hash at position i means equal text up to
the end of block i. Only full blocks
count (vLLM caches only full blocks).

Approximate by design: images and tool definitions do not enter the text, and a different chat
template rendering of equal messages would still match. Python's ``hash`` is salted per process;
each process has its own index (``PrefixIndex``), so that is fine.
"""

from __future__ import annotations

from typing import Any

BLOCK_CHARS = 256  # characters per block: ~64 tokens at the gateway's 4 characters a token
BLOCK_IDS = 64  # token ids per block, for prompts given as token ids
MAX_PROMPT_BLOCKS = 1024  # blocks hashed per prompt (256k characters); the rest does not steer routing
_SEP = "\x1f"  # between a message's fields and between messages: "ab"+"c" is not "a"+"bc"


def prompt_blocks(body: dict[str, Any], block_chars: int = BLOCK_CHARS) -> tuple[int, ...]:
    """The chained hashes of the full blocks of the request's prompt (``messages``, ``prompt``
    or the Responses API's ``input``), first block first; () when there is no full block or the
    body has an unexpected shape. Never raises."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return _chain_text(_messages_text(messages), block_chars)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _chain_text(prompt, block_chars)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int) and not isinstance(first, bool):
            return _chain_ids(prompt)
        if isinstance(first, list):  # a batch of token-id prompts: the first one steers
            return _chain_ids(first)
        return _chain_text(_SEP.join(p for p in prompt if isinstance(p, str)), block_chars)
    inputs = body.get("input")
    if isinstance(inputs, str):
        return _chain_text(inputs, block_chars)
    if isinstance(inputs, list):
        return _chain_text(_messages_text(inputs), block_chars)
    return ()


def _messages_text(messages: list) -> str:
    texts: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        for v in m.values():  # role, name, content, tool_call_id ... in the client's order
            if isinstance(v, str):
                texts.append(v)
            elif isinstance(v, list):
                for p in v:  # content parts' text, tool calls' arguments
                    if isinstance(p, str):
                        texts.append(p)
                    elif isinstance(p, dict):
                        text = p.get("text")
                        if isinstance(text, str):
                            texts.append(text)
                        fn = p.get("function")
                        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                            texts.append(fn["arguments"])
        texts.append("")  # closes the message
    return _SEP.join(texts)


def _chain_text(text: str, block_chars: int) -> tuple[int, ...]:
    end = min(len(text) // block_chars, MAX_PROMPT_BLOCKS) * block_chars
    h = 0
    out = []
    for i in range(0, end, block_chars):
        h = hash((h, text[i:i + block_chars]))
        out.append(h)
    return tuple(out)


def _chain_ids(ids: list) -> tuple[int, ...]:
    end = min(len(ids) // BLOCK_IDS, MAX_PROMPT_BLOCKS) * BLOCK_IDS
    h = 1  # token-id blocks never equal text blocks
    out = []
    for i in range(0, end, BLOCK_IDS):
        try:
            h = hash((h, tuple(ids[i:i + BLOCK_IDS])))
        except TypeError:  # an unhashable item: the engine will refuse the prompt anyway
            break
        out.append(h)
    return tuple(out)
