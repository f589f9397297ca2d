"""The test models' tokenizer trainer: byte-level BPE on a fixed corpus.

The one tokenizer trainer of the test models: a byte-level BPE trained on a small fixed
corpus (deterministic: the same vocabulary every build), with each family's special tokens
and chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def corpus() -> list[str]:
    words = (
        "the a an image picture photo shows shown color red green blue black white dog cat "
        "car tree house sky water person people is are of in on with and what describe this "
        "that there here left right top bottom large small one two three many answer question"
    ).split()
    lines = []
    for i in range(2000):
        n = 5 + i % 11
        lines.append(" ".join(words[(i * 7 + j * 13) % len(words)] for j in range(n)))
    return lines


def train_tokenizer(out: Path, vocab_size: int, specials: list[str], template: str,
                    unk_token: str | None = None, **named: Any):
    """Train, save into `out` and return a fast tokenizer.

    `specials`: the special tokens (ids 0, 1, ... in this order); `unk_token`: the unknown
    token, if the family has one; `named`: the tokens transformers knows by role (`bos_token`,
    `eos_token`, `pad_token`, `extra_special_tokens`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=unk_token))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    roles = {"unk_token": unk_token} if unk_token is not None else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **roles, **named)
    fast.chat_template = template
    fast.save_pretrained(out)
    return fast
