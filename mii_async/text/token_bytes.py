"""The bytes each token stands for: a guide's automaton reads the vocabulary as bytes (workers/sampling/guide_child.py),
and OpenAI's chat logprobs give each token's `bytes`, which joined spell the output even where a token holds
part of a character (decode([id]) shows such a token as U+FFFD). Through `tokenizers` only: no torch.

ByteLevel vocabularies (GPT-2, Llama 3, Qwen2, SmolLM) write bytes in GPT-2's printable stand-ins;
SentencePiece ones (Llama 2, Mistral) write a space as ▁ and raw bytes as <0xHH>; added tokens stand for their
text.
"""
from __future__ import annotations

from typing import Any


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes (a ByteLevel tokenizer's vocabulary is written in them) → byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenSpeller:
    """Token id → its bytes, for a `tokenizers.Tokenizer` or a transformers fast tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tk = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.added = self.tk.get_added_tokens_decoder()
        self.dec = _byte_decoder() if "ByteLevel" in repr(self.tk.decoder) else {}

    @classmethod
    def of(cls, tokenizer: Any) -> TokenSpeller | None:
        """A speller for `tokenizer`, or None where it has no `tokenizers` backend (a slow tokenizer)."""
        tk = getattr(tokenizer, "backend_tokenizer", tokenizer)
        ok = all(hasattr(tk, a) for a in ("get_added_tokens_decoder", "id_to_token", "decoder"))
        return cls(tokenizer) if ok else None

    def spell(self, token_id: int, tok: str | None = None) -> bytes:
        """The bytes of `token_id` (b"" for an id outside the vocabulary); `tok`: its vocabulary entry, if
        known already."""
        if (added := self.added.get(token_id)) is not None:
            return added.content.encode("utf-8")
        tok = self.tk.id_to_token(token_id) if tok is None else tok
        if tok is None:
            return b""
        if self.dec and all(c in self.dec for c in tok):
            return bytes(self.dec[c] for c in tok)
        if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            return bytes([int(tok[3:5], 16)])
        return tok.replace("▁", " ").encode("utf-8")


def token_bytes(tokenizer: Any) -> dict[bytes, list[int]]:
    """Each token's bytes → its ids. Special tokens are left out: a guide never allows them."""
    sp = TokenSpeller(tokenizer)
    out: dict[bytes, list[int]] = {}
    for tok, i in sp.tk.get_vocab(with_added_tokens=False).items():
        if i in sp.added:
            continue
        if b := sp.spell(i, tok):
            out.setdefault(b, []).append(i)
    for i, t in sp.added.items():
        if not t.special and t.content:
            out.setdefault(t.content.encode("utf-8"), []).append(i)
    return out
