"""Which text calibration draws its units from, how many it needs, and the draws themselves.

A unit is a window of ``prompt_tokens + new_tokens`` tokens drawn i.i.d. from a
corpus (:class:`edge.core.data.TokenCorpus`: document uniformly at random among
those long enough, offset uniformly at random). Its first ``prompt_tokens``
tokens are the prompt the engine continues; the rest is the natural
continuation, used for the teacher-forced figures. Fit, certify, propagate-test
and evaluation units are independent draws (seeds spawned from one seed).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge.core.data import Document, Split, TokenCorpus, Windows, load_split, load_text_dir, split_by_hash
from edge.core.errors import ConfigError

DRAWS = ("fit", "certify", "propagate", "eval", "crossfit", "order")


@dataclass
class Corpora:
    calibration: TokenCorpus
    evaluation: TokenCorpus
    calibration_name: str  # what the certificate is about, in words
    evaluation_name: str


def corpora(tok, calib_data: str | None, eval_data: str | None, heldout_percent: int) -> Corpora:
    """The calibration corpus (the shipped calibration split, or the part of ``calib_data`` not held
    out) and the evaluation corpus (``eval_data``, else the held-out part of ``calib_data``, else the
    shipped test split).

    Raises:
        ConfigError / SmartExitError: a missing or empty folder, or a split leaving one side empty.
    """
    if calib_data:
        docs = load_text_dir(calib_data)
        cal_docs, held = split_by_hash(docs, heldout_percent)
        if not cal_docs or not held:
            raise ConfigError(f"--calib-data {calib_data}: its {len(docs)} documents split into {len(cal_docs)} for "
                              f"calibration and {len(held)} held out ({heldout_percent}% by hash of the relative "
                              f"path); both parts need documents: add files")
        cal_name = (f"the {len(cal_docs)} documents of {calib_data} not held out "
                    f"(sha256 of the relative path, {100 - heldout_percent}%)")
        ev_docs: list[Document] = held
        ev_name = f"the {len(held)} held-out documents of {calib_data}"
    else:
        cal_docs = load_split(Split.CALIBRATION)
        cal_name = f"the shipped calibration split ({len(cal_docs)} Python standard-library files)"
        ev_docs, ev_name = load_split(Split.TEST), f"the shipped test split ({len(load_split(Split.TEST))} files)"
    if eval_data:
        ev_docs = load_text_dir(eval_data)
        ev_name = f"{len(ev_docs)} documents of {eval_data}"
    return Corpora(TokenCorpus(tok, cal_docs), TokenCorpus(tok, ev_docs), cal_name, ev_name)


def check_amount(corpus: TokenCorpus, name: str, length: int, units: int, min_documents: int,
                 need_units: str) -> None:
    """Refuse a corpus too small to draw ``units`` windows of ``length`` tokens from at least
    ``min_documents`` documents, with the minimum amounts in the message."""
    docs = corpus.eligible(length).size
    windows = corpus.positions(length)
    need_tokens = units + min_documents * (length - 1)  # min_documents documents holding >= units windows
    if docs < min_documents or windows < units:
        raise ConfigError(
            f"too little calibration data in {name}: {docs} documents have at least {length} tokens "
            f"({windows} distinct {length}-token windows, {corpus.tokens} tokens in all). {need_units}: "
            f"{units} prompts in all, drawn from at least {min_documents} documents of >= {length} tokens "
            f"holding at least {units} distinct windows (about {need_tokens} tokens). Add text, or lower "
            f"min_documents / the unit counts, or raise epsilon / delta")


def seeds(seed: int) -> dict[str, int]:
    """Independent integer seeds, one per draw in :data:`DRAWS`."""
    states = np.random.SeedSequence(seed).spawn(len(DRAWS))
    return {name: int(s.generate_state(1)[0]) for name, s in zip(DRAWS, states)}


def draw(corpus: TokenCorpus, n: int, length: int, seed: int) -> Windows:
    return corpus.draw(n, length, seed)


def corpus_path(calib_data: str | None) -> str:
    return str(Path(calib_data).resolve()) if calib_data else "shipped calibration split"
