"""A token's own bytes, as OpenAI's logprobs give them (`bytes`): a token that holds part of a
multi-byte character decodes alone to U+FFFD, so its text cannot be joined back into the
character; its bytes can. Read from the tokenizer's vocabulary piece: byte-level BPE (GPT-2,
Llama 3, Qwen) spells each byte as one printable character; SentencePiece spells a space "▁" and a
byte it has no piece for "<0xNN>"; an added (special) token is its text."""
from __future__ import annotations

import re

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SENTENCEPIECE_SPACE = "\u2581"


class TokenBytes:
    """`token_bytes(token_id)`: the token's bytes (cached per id). A tokenizer this cannot read the
    pieces of (no fast backend) gives the UTF-8 of the token decoded alone, as before."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, bytes] = {}
        self.added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self.byte_level = _byte_level_table(tokenizer)
        self.sentencepiece = self.byte_level is None and _sentencepiece(tokenizer)

    def __call__(self, token_id: int) -> bytes:
        found = self.cache.get(token_id)
        if found is None:
            found = self.cache[token_id] = self._read(token_id)
        return found

    def _read(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        byte = _BYTE_PIECE.fullmatch(piece) if self.sentencepiece and isinstance(piece, str) else None
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        if not isinstance(piece, str) or not (self.byte_level or self.sentencepiece):
            return self.tokenizer.decode([token_id]).encode("utf-8")
        if self.byte_level is not None and all(ch in self.byte_level for ch in piece):
            return bytes(self.byte_level[ch] for ch in piece)
        return piece.replace(SENTENCEPIECE_SPACE, " ").encode("utf-8")


def _byte_level_table(tokenizer) -> dict[str, int] | None:
    """Character -> byte for a byte-level BPE tokenizer (its decoder is ByteLevel); None otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import decoders
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    return byte_level_alphabet()


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level spelling, character -> byte: a printable byte (but space) is its own
    character; each of the others, in byte order, the next character from U+0100 on."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    alphabet, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(0x100 + shifted)] = byte
            shifted += 1
    return alphabet


def _sentencepiece(tokenizer) -> bool:
    """A fast tokenizer that spells SentencePiece's pieces: byte pieces (<0x0A>) or a Metaspace decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    from tokenizers import decoders
    return isinstance(backend.decoder, decoders.Metaspace) or backend.token_to_id("<0x0A>") is not None
