"""A word-level tokenizer over a random-weight model's vocabulary, so that a deployment (whose router tokenizes
and detokenizes) can serve a model that was built without one: "<unk>", "<s>", "</s>", then "w3", "w4", …"""
from __future__ import annotations

from pathlib import Path


def save_word_tokenizer(out_dir: str | Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")          # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<unk>").save_pretrained(str(out_dir))
