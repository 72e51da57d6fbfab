"""Tiny SentencePiece-style tokenizers built locally (no hub): BPE with byte fallback, `▁` for spaces.

Two decoders as real checkpoints ship them: Llama-2/Mistral's (Replace ▁, ByteFallback, Fuse, Strip the first
space) and Gemma's (no Strip). Ids 0–2 are <unk> <s> </s> (special), 3–258 the byte tokens <0x00>…<0xFF>,
the last id a non-special added token "<tool>".
"""
from __future__ import annotations

import json

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = ["Hello world, this is the end of it.", "The capital of France is Paris.", "你好世界 中文 字",
          "User: hi\n\nAssistant: hello there", "naïve café résumé", "one two three four five"] * 20
BYTE0 = 3  # id of <0x00>


def byte_id(b: int) -> int:
    return BYTE0 + b


def spm_tokenizer(strip_first_space: bool = True) -> PreTrainedTokenizerFast:
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                            show_progress=False))
    spec = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": byte_id(b) for b in range(256)}
    for piece, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip_first_space else []))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
