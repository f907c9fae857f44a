"""The bundled corpus: the Python standard library's source, split by file.

Each ``.py`` file of the running interpreter's standard library (site-packages
excluded) goes to train / calibration / test by the sha256 of its relative
path, so the split is deterministic and independent of file order. The
calibration and test splits are shipped with the project (``edge/assets/data``,
xz-compressed JSON lines) so every machine sees byte-identical text whatever
Python it runs; only training reads the interpreter's files.
"""
from __future__ import annotations

import enum
import hashlib
import json
import lzma
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edge.core.errors import SmartExitError

if TYPE_CHECKING:
    import numpy as np

ASSETS = Path(__file__).parents[1] / "assets"
DATA_DIR = ASSETS / "data"
CALIB_PERCENT = 4  # buckets 0..3 -> calibration
TEST_PERCENT = 4  # buckets 4..7 -> test


class Split(str, enum.Enum):
    TRAIN = "train"
    CALIBRATION = "calibration"
    TEST = "test"


@dataclass(frozen=True)
class Document:
    path: str  # relative to the source root
    text: str


def split_of(rel_path: str) -> Split:
    """Deterministic split for a file, from the first 8 hex digits of sha256(path) mod 100."""
    bucket = int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16) % 100
    if bucket < CALIB_PERCENT:
        return Split.CALIBRATION
    if bucket < CALIB_PERCENT + TEST_PERCENT:
        return Split.TEST
    return Split.TRAIN


def stdlib_documents(root: str | Path | None = None) -> list[Document]:
    """All UTF-8 ``.py`` files under the standard library (sorted by path)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    docs = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel.split("/") or "dist-packages" in rel.split("/"):
            continue
        try:
            docs.append(Document(rel, p.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return docs


def split_documents(docs: list[Document]) -> dict[Split, list[Document]]:
    out: dict[Split, list[Document]] = {s: [] for s in Split}
    for d in docs:
        out[split_of(d.path)].append(d)
    return out


def write_jsonl_xz(path: Path, docs: list[Document]) -> None:
    from edge.core.artifacts import atomic_path

    with atomic_path(path) as tmp:
        with lzma.open(tmp, "wt", encoding="utf-8", preset=9) as f:
            for d in docs:
                f.write(json.dumps({"path": d.path, "text": d.text}) + "\n")


def read_jsonl_xz(path: Path) -> list[Document]:
    try:
        with lzma.open(path, "rt", encoding="utf-8") as f:
            return [Document(**json.loads(line)) for line in f if line.strip()]
    except (OSError, lzma.LZMAError, json.JSONDecodeError, TypeError) as exc:
        raise SmartExitError(f"{path} is not a valid xz-compressed JSON-lines corpus: {exc}") from exc


def load_split(split: Split | str) -> list[Document]:
    """The shipped calibration / test split, or the interpreter's train split."""
    split = Split(split)
    if split is Split.TRAIN:
        return split_documents(stdlib_documents())[Split.TRAIN]
    path = DATA_DIR / f"{split.value}.jsonl.xz"
    if not path.is_file():
        raise SmartExitError(f"{path} is missing: the shipped {split.value} split is part of the package")
    return read_jsonl_xz(path)


def heldout_prompts(tok, docs: list[Document], n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens, each from a distinct document of ``docs`` (seeded)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = []
    for i in rng.permutation(len(docs)):
        ids = tok.encode(docs[i].text).ids
        if len(ids) < length + 1:
            continue
        start = int(rng.integers(0, len(ids) - length))
        prompts.append(ids[start:start + length])
        if len(prompts) == n:
            break
    if len(prompts) < n:
        raise SmartExitError(f"only {len(prompts)} documents have >= {length + 1} tokens; {n} prompts were asked for")
    return prompts


def split_by_hash(docs: list[Document], heldout_percent: int) -> tuple[list[Document], list[Document]]:
    """A user's corpus split by document: (calibration part, held-out part).

    A document is held out when int(sha256("heldout:" + relative path)[:8], 16) % 100 < heldout_percent,
    so the split is deterministic, independent of file order, and whole documents stay on one side.
    """
    if not 0 < heldout_percent < 100:
        raise SmartExitError(f"held-out percentage must be in (0, 100), got {heldout_percent}")
    calib, held = [], []
    for d in docs:
        bucket = int(hashlib.sha256(f"heldout:{d.path}".encode()).hexdigest()[:8], 16) % 100
        (held if bucket < heldout_percent else calib).append(d)
    return calib, held


@dataclass(frozen=True)
class Windows:
    """Token windows drawn from a corpus: ``ids[i]`` is ``length`` tokens of document ``doc[i]`` from
    ``offset[i]``."""

    ids: "np.ndarray"  # [n, length] int64
    doc: "np.ndarray"  # [n] index into TokenCorpus.docs
    offset: "np.ndarray"  # [n]


class TokenCorpus:
    """Documents encoded once; token windows drawn i.i.d. from them.

    A draw picks a document uniformly at random among those with at least ``length`` tokens, then an
    offset uniformly at random within it: each draw is independent of every other draw (with
    replacement), so units drawn with different seeds are independent samples of one fixed
    distribution, which is what a certificate over units needs.
    """

    def __init__(self, tok, docs: list[Document]) -> None:
        import numpy as np

        self.docs = docs
        self.ids = [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch([d.text for d in docs])]
        self.lengths = np.array([len(x) for x in self.ids], dtype=np.int64)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def eligible(self, length: int) -> "np.ndarray":
        """Indices of the documents with at least ``length`` tokens."""
        import numpy as np

        return np.flatnonzero(self.lengths >= length)

    def positions(self, length: int) -> int:
        """Number of distinct windows of ``length`` tokens."""
        ok = self.lengths >= length
        return int((self.lengths[ok] - length + 1).sum())

    def draw(self, n: int, length: int, seed: int) -> Windows:
        """``n`` windows of ``length`` tokens, i.i.d.: document uniform over the eligible ones, offset
        uniform within it (seeded).

        Raises:
            SmartExitError: no document has ``length`` tokens.
        """
        import numpy as np

        ok = self.eligible(length)
        if ok.size == 0:
            raise SmartExitError(f"no document has {length} tokens (the longest has {int(self.lengths.max(initial=0))})")
        rng = np.random.default_rng(seed)
        doc = ok[rng.integers(0, ok.size, n)]
        offset = (rng.random(n) * (self.lengths[doc] - length + 1)).astype(np.int64)
        ids = np.stack([self.ids[d][o:o + length] for d, o in zip(doc, offset)]) if n else np.zeros((0, length), np.int64)
        return Windows(ids, doc, offset)


def load_text_dir(folder: str | Path, suffixes: tuple[str, ...] = (".txt", ".py", ".md")) -> list[Document]:
    """A user's folder of text files as documents (for ``--eval-data DIR`` / ``--calib-data DIR``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SmartExitError(f"data folder {folder} does not exist")
    docs = []
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.suffix in suffixes:
            try:
                docs.append(Document(p.relative_to(folder).as_posix(), p.read_text(encoding="utf-8")))
            except UnicodeDecodeError as exc:
                raise SmartExitError(f"{p} is not UTF-8 text: {exc}") from exc
    if not docs:
        raise SmartExitError(f"{folder} holds no text files ({', '.join(suffixes)})")
    return docs


def ship_splits(out_dir: Path = DATA_DIR) -> dict:
    """Write the calibration / test splits and ``split.json`` (file lists and hashes)."""
    import platform

    from edge.core.artifacts import atomic_write_json

    parts = split_documents(stdlib_documents())
    record = {
        "source": "Python standard library .py files (site-packages excluded)",
        "python": platform.python_version(),
        "rule": f"bucket = int(sha256(relative_path)[:8], 16) % 100; <{CALIB_PERCENT} calibration, "
                f"<{CALIB_PERCENT + TEST_PERCENT} test, else train",
        "splits": {},
    }
    for split, docs in parts.items():
        record["splits"][split.value] = {
            "files": len(docs),
            "bytes": sum(len(d.text.encode()) for d in docs),
            "paths_sha256": hashlib.sha256("\n".join(d.path for d in docs).encode()).hexdigest(),
        }
        if split is not Split.TRAIN:
            write_jsonl_xz(out_dir / f"{split.value}.jsonl.xz", docs)
            record["splits"][split.value]["paths"] = [d.path for d in docs]
    atomic_write_json(out_dir / "split.json", record)
    return record
