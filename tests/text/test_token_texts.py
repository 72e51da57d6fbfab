"""TokenizerTexts: the texts (decode([id])) and bytes of a vocabulary's tokens, decoded once per id and shared by
every request of a tokenizer; what a Delta carries is the table of just the ids it names."""
from __future__ import annotations

import transformers

from mii_async.outputs import TokenTexts
from mii_async.text.token_texts import TokenizerTexts, texts_of
from tests.text.spm_tokenizers import byte_id, spm_tokenizer


class CountingTokenizer:
    """decode([id]) is "t{id} "; counts the calls. No `tokenizers` backend: a token's bytes are its text's."""

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        return "".join(f"t{i} " for i in ids)


def test_each_id_is_decoded_once_and_a_subset_is_what_a_delta_carries():
    """The first text of an id decodes it, the next ones read the cache; a subset holds exactly its ids, with
    the same texts and bytes, and needs no tokenizer."""
    tok = CountingTokenizer()
    texts = TokenizerTexts(tok)
    assert [texts.text(i) for i in (1, 2, 1, 9, 2)] == ["t1 ", "t2 ", "t1 ", "t9 ", "t2 "] and tok.calls == 3
    assert texts.token_bytes(9) == b"t9 " and texts.token_bytes(3) == b"t3 " and tok.calls == 4
    sub = texts.subset({9, 3})
    assert type(sub) is TokenTexts and sub == TokenTexts({9: "t9 ", 3: "t3 "}) and tok.calls == 4
    assert (sub.text(3), sub.token_bytes(9)) == ("t3 ", b"t9 ")


def test_every_request_of_a_tokenizer_shares_one_cache():
    """texts_of gives one TokenizerTexts per tokenizer object."""
    a, b = CountingTokenizer(), CountingTokenizer()
    assert texts_of(a) is texts_of(a) and texts_of(a) is not texts_of(b) and texts_of(a).tokenizer is a


def test_bytes_spell_what_the_text_cannot_show(default_model_dir):
    """A byte-level token holding part of a character shows U+FFFD as its text, while its bytes are the raw
    byte (OpenAI's chat `bytes`); a SentencePiece token's text drops its leading space, its bytes keep it. Only
    such tokens carry bytes of their own."""
    tok = transformers.AutoTokenizer.from_pretrained(str(default_model_dir))
    part = tok.convert_tokens_to_ids("Ã")        # GPT-2's stand-in for the byte 0xC3, a character's first half
    whole = tok.convert_tokens_to_ids("Hello")
    texts = TokenizerTexts(tok)
    assert (texts.text(part), texts.token_bytes(part)) == (tok.decode([part]), b"\xc3") and "\ufffd" in texts.text(part)
    assert (texts.text(whole), texts.token_bytes(whole)) == ("Hello", b"Hello")
    assert texts.subset([part, whole]).spelled == {part: b"\xc3"}
    spm = spm_tokenizer()
    sp_texts = TokenizerTexts(spm)
    word = spm.convert_tokens_to_ids("▁three▁")
    assert (sp_texts.text(word), sp_texts.token_bytes(word)) == (spm.decode([word]), b" three ")
    assert sp_texts.text(word) == "three "
    assert sp_texts.token_bytes(byte_id(0xE4)) == b"\xe4"
