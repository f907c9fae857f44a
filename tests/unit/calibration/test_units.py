"""Calibration units: i.i.d. windows drawn from a corpus, and a user's corpus split by document."""
from __future__ import annotations

import numpy as np
import pytest

from calibration.units import check_amount, seeds
from edge.core.data import Document, TokenCorpus, split_by_hash
from edge.core.errors import ConfigError, SmartExitError


class _Tok:
    """One token per character (ids = code points), enough to test drawing."""

    class _Enc:
        def __init__(self, text: str) -> None:
            self.ids = [ord(c) for c in text]

    def encode_batch(self, texts):
        return [self._Enc(t) for t in texts]


def _corpus(lengths: list[int]) -> TokenCorpus:
    return TokenCorpus(_Tok(), [Document(f"d{i}.py", chr(65 + i) * n) for i, n in enumerate(lengths)])


def test_draws_are_windows_of_eligible_documents_chosen_uniformly():
    corpus = _corpus([5, 50, 200, 10, 80])
    w = corpus.draw(20_000, 10, seed=0)
    assert w.ids.shape == (20_000, 10)
    assert set(np.unique(w.doc)) == {1, 2, 3, 4}  # document 0 is too short
    counts = np.bincount(w.doc, minlength=5)[1:] / 20_000
    assert np.allclose(counts, 0.25, atol=0.02)  # uniform over documents, not over tokens
    assert (w.offset >= 0).all() and (w.offset + 10 <= corpus.lengths[w.doc]).all()
    assert (w.ids == (65 + w.doc)[:, None]).all()  # each window lies in its document
    # offsets uniform over the positions of a document: document 2 has 191
    off = w.offset[w.doc == 2]
    assert off.min() == 0 and off.max() == 190 and abs(off.mean() - 95) < 5
    assert corpus.positions(10) == 41 + 191 + 1 + 71 and corpus.eligible(10).tolist() == [1, 2, 3, 4]


def test_draws_are_reproducible_and_seeds_are_independent():
    corpus = _corpus([100, 100, 100])
    a, b = corpus.draw(50, 10, 3), corpus.draw(50, 10, 3)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.offset, b.offset)
    s = seeds(0)
    assert len(set(s.values())) == len(s) and seeds(0) == s and seeds(1) != s
    with pytest.raises(SmartExitError, match="no document has 101 tokens"):
        corpus.draw(1, 101, 0)


def test_split_by_hash_is_by_document_and_deterministic():
    docs = [Document(f"pkg/m{i}.py", "x") for i in range(2000)]
    cal, held = split_by_hash(docs, 30)
    assert len(cal) + len(held) == 2000 and 0.25 < len(held) / 2000 < 0.35
    assert not {d.path for d in cal} & {d.path for d in held}
    cal2, held2 = split_by_hash(list(reversed(docs)), 30)
    assert {d.path for d in held2} == {d.path for d in held}
    with pytest.raises(SmartExitError, match=r"in \(0, 100\)"):
        split_by_hash(docs, 0)


def test_too_little_data_names_the_minimum():
    corpus = _corpus([30, 30, 30])
    with pytest.raises(ConfigError) as err:
        check_amount(corpus, "my corpus", 20, 400, 5, "Certifying needs at least 369 certify prompts")
    msg = str(err.value)
    assert "3 documents have at least 20 tokens (33 distinct 20-token windows, 90 tokens in all)" in msg
    assert "at least 369 certify prompts" in msg and "at least 5 documents of >= 20 tokens" in msg
    assert "about 495 tokens" in msg  # 400 windows + 5 documents * 19
    check_amount(_corpus([500] * 5), "enough", 20, 400, 5, "")
