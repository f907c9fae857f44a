"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``) for the bundled model."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

from edge.core.errors import SmartExitError

EOS = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096):
    """Train a GPT-2 style byte-level BPE; id 0 is ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise SmartExitError(f"tokenizer file {path} is missing")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on parse errors
        raise SmartExitError(f"{path} is not a valid tokenizer.json: {exc}") from exc


def encode_documents(tok, texts: list[str], eos_id: int = 0) -> np.ndarray:
    """Token ids of all documents, each followed by EOS, as one uint16 stream."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.uint16)
