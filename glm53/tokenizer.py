"""A thin wrapper over HF ``tokenizers`` for ``tokenizer.json`` files, so ``generate`` accepts strings."""

from __future__ import annotations

import os


class Tokenizer:
    def __init__(self, tokenizer):
        self._tok = tokenizer

    @classmethod
    def from_file(cls, path: str) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        if not os.path.exists(path):
            raise FileNotFoundError(f"no tokenizer file at {path}")
        try:
            return cls(HFTokenizer.from_file(path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed JSON
            raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from e

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str) -> None:
        self._tok.save(path)
