"""Text in and out: a checkpoint's ``tokenizer.json`` through the Hugging Face ``tokenizers`` library.

DeepSeek-V3/R1 ships ``tokenizer.json`` (a byte-level BPE with a post-processor that prepends the BOS
token) next to ``config.json``; :func:`load_tokenizer` reads it when present.  ``encode`` applies the
tokenizer's post-processor (BOS as the checkpoint defines it); ``decode`` skips special tokens (BOS, EOS).
"""

from __future__ import annotations

import os
from collections.abc import Sequence


class Tokenizer:
    """A thin wrapper of ``tokenizers.Tokenizer``: ``encode(text) -> ids``, ``decode(ids) -> text``."""

    def __init__(self, tok, path: str | None = None):
        self._tok = tok
        self.path = path

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = os.fspath(path)
        try:
            return cls(HFTokenizer.from_file(path), path)
        except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception on malformed files)
            raise ValueError(f"tokenizer.json: cannot load {path!r} ({e})") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def load_tokenizer(checkpoint_dir: str | os.PathLike) -> Tokenizer | None:
    """The ``tokenizer.json`` of a checkpoint directory (or the file itself), None when there is none.

    In a directory, ``tokenizer.json`` follows the checkpoint's link policy
    (:func:`tokenspeed_jax.models.deepseek.weights.checkpoint_file`): a link resolving outside the directory
    (or its Hugging Face cache repository) raises ``CheckpointError``."""
    path = os.fspath(checkpoint_dir)
    if os.path.isdir(path):
        from tokenspeed_jax.models.deepseek.weights import checkpoint_file

        if not os.path.lexists(os.path.join(path, "tokenizer.json")):
            return None
        path = checkpoint_file(path, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    return Tokenizer.from_file(path)
