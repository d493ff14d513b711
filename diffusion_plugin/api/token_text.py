"""What a committed token is in the returned text: its string, its bytes and where it starts.

A byte-level tokenizer can split one character over several tokens (``Ѣ`` is two byte tokens
of the tiny models' BPE; a 4-byte emoji can be three). Settled here, once for every route and
for streamed and whole answers alike:

- **A token's string** is the token decoded alone, as vLLM names it (``tokenizer.decode([id])``):
  a token holding part of a character is ``"\\ufffd"``.
- **A token's bytes** (chat's ``bytes``) are the bytes it contributes, as OpenAI defines the
  field: joined over a choice's tokens they are the UTF-8 of its text (special tokens, which the
  text skips, aside). Byte-level BPE and byte-fallback tokenizers map tokens to bytes; any other
  tokenizer's token gives its string's UTF-8.
- **A token's text offset** (completions' ``text_offset``) is the length of the text that the
  tokens before it decode to, less a trailing run of ``"\\ufffd"`` (an incomplete character):
  it is where, in the returned text, the character holding the token's first byte starts, so
  the tokens of one split character share an offset. It is a function of the tokens before it
  only, so a stream, whatever its blocks, gives the same offsets as the whole answer. (vLLM's
  whole answer adds each token string's length instead, which runs past the text after a split
  character, and its stream restarts at the text sent; where no character is split the two
  agree.)
"""

from __future__ import annotations

import functools
import re

_REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, inverted (byte-level BPE pieces -> bytes)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_kind(tok) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    described = repr(getattr(backend, "decoder", None))
    if "ByteLevel" in described:
        return "byte_level"
    if "ByteFallback" in described:
        return "byte_fallback"
    return "text"


def token_bytes(tok, token_id: int) -> list[int]:
    """The bytes a token contributes to the text (see the module's docstring)."""
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    kind = _decoder_kind(tok)
    if token_id not in added and kind != "text":
        piece = tok.convert_ids_to_tokens([token_id])[0]
        if isinstance(piece, str):
            if kind == "byte_level":
                table = _byte_decoder()
                if all(c in table for c in piece):
                    return [table[c] for c in piece]
            else:
                m = _BYTE_PIECE.fullmatch(piece)
                if m:
                    return [int(m.group(1), 16)]
                return list(piece.replace("\u2581", " ").encode("utf-8"))
    return list(tok.decode([token_id]).encode("utf-8"))


def token_string(tok, token_id: int) -> str:
    """A token as logprobs name it: decoded alone, special tokens included (the text skips them)."""
    return tok.decode([token_id])


class TextOffsets:
    """Each token's offset into its choice's text (see the module's docstring), fed one token at a
    time in order. Decodes from the last two anchors (tokens before which the text is complete;
    the older one gives the decoder context for its start-of-text rules), as vLLM's incremental
    detokenizer does, so the cost per token does not grow with the text."""

    def __init__(self, tok):
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0  # the anchor before ``anchor``
        self.anchor = 0  # the tokens before it decode to complete text ...
        self.anchor_offset = 0  # ... of this many characters

    def push(self, token_id: int) -> int:
        """The offset of ``token_id``, the next token of the choice."""
        i = len(self.ids)
        head = len(self._decode(self.prefix, self.anchor))
        text = self._decode(self.prefix, i)
        complete = text.rstrip(_REPLACEMENT)
        offset = self.anchor_offset + max(0, len(complete) - head)
        self.ids.append(token_id)
        if i > self.anchor and len(complete) == len(text):  # complete before this token: a new anchor
            self.prefix, self.anchor, self.anchor_offset = self.anchor, i, offset
        return offset

    def _decode(self, start: int, end: int) -> str:
        return self.tok.decode(self.ids[start:end], skip_special_tokens=True) if end > start else ""
