"""llama.cpp's tokenizer against ours.

Ours is GPT-2's byte-level BPE (``edge.model.tokenizer.train_tokenizer``), which llama.cpp implements as the
``gpt-2`` pre-type. The conversion (``llamacpp_gguf``) falls back to that pre-type for a pre-tokenizer hash
the converter does not know only after :func:`tokenizer_is_gpt2_byte_level` has checked the actual
pre-tokenizer, decoder and model of ``tokenizer.json`` (pure JSON inspection). :func:`verify_tokenizer`
then checks that the converted tokenizer reproduces ours id for id.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from edge.core.errors import SmartExitError
from edge.pipeline.bench.llamacpp_peer import LlamaCppPeer


class TokenizerMismatch(SmartExitError):
    """llama.cpp's tokenizer (from the GGUF) gives other ids than ours for some text."""


# ------------------------------------------------------------------ tokenizer: pure JSON inspection
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (openai/gpt-2 ``encoder.py``), 256 entries."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _as_json(tokenizer_json: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(tokenizer_json, dict):
        return tokenizer_json
    path = Path(tokenizer_json)
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SmartExitError(f"{path} is not a readable tokenizer.json: {exc}") from exc


def gpt2_byte_level_mismatch(tokenizer_json: str | Path | dict[str, Any]) -> str | None:
    """Why a ``tokenizer.json`` is not GPT-2-style byte-level BPE, or None when it is.

    GPT-2 style means what llama.cpp's ``gpt-2`` pre-type implements: no normalizer; a single
    ByteLevel pre-tokenizer with GPT-2's split regex (``use_regex``) and no added prefix space;
    a BPE model without byte fallback or subword affixes whose vocabulary is written in GPT-2's
    byte alphabet (added tokens aside); a ByteLevel decoder.

    Args:
        tokenizer_json: path to the file or its model folder, or the parsed JSON.
    """
    tj = _as_json(tokenizer_json)
    if tj.get("normalizer") is not None:
        return f"it has a normalizer ({tj['normalizer'].get('type')}); GPT-2 has none"
    pre = tj.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel":
        return f"pre_tokenizer is {pre.get('type')!r}, not a single ByteLevel"
    if not pre.get("use_regex", True):
        return "the ByteLevel pre_tokenizer does not split with GPT-2's regex (use_regex is false)"
    if pre.get("add_prefix_space", False):
        return "the ByteLevel pre_tokenizer adds a prefix space; llama.cpp's gpt-2 pre-type does not"
    dec = tj.get("decoder") or {}
    if dec.get("type") != "ByteLevel":
        return f"decoder is {dec.get('type')!r}, not ByteLevel"
    post = tj.get("post_processor")
    if post is not None and post.get("type") != "ByteLevel":
        return f"post_processor {post.get('type')!r} adds tokens; GPT-2 adds none"
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        return f"model is {model.get('type')!r}, not BPE"
    if model.get("byte_fallback"):
        return "the BPE model uses byte fallback (SentencePiece style), not byte-level tokens"
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"the BPE model has a {key} ({model[key]!r}); GPT-2 has none"
    alphabet = set(bytes_to_unicode().values())
    added = {t["content"] for t in tj.get("added_tokens", [])}
    vocab = model.get("vocab") or {}
    if not vocab:
        return "the BPE model has an empty vocabulary"
    for token in vocab:
        if token not in added and not set(token) <= alphabet:
            return f"vocabulary token {token!r} is not written in GPT-2's byte alphabet"
    return None


def tokenizer_is_gpt2_byte_level(tokenizer_json: str | Path | dict[str, Any]) -> bool:
    """True when ``tokenizer.json`` is GPT-2-style byte-level BPE (see :func:`gpt2_byte_level_mismatch`)."""
    return gpt2_byte_level_mismatch(tokenizer_json) is None


# ------------------------------------------------------------------ checks against ours
EDGE_CASES = (
    "", " ", "  ", "\n", "\n\n\n", "\t", "\t\t x", "a  b   c    d", "   leading", "trailing   ",
    "x = 1\n    \n\ty = 2\r\n", "if x:\n\tpass\n\n\n        return", "3 33 333 3333 3.14 1e-5 0x1F",
    "I'm sure you'll see it's 'quoted' and \"double\" 'S 'LL", "héllo wörld naïve café", "日本語のテキスト 中文",
    "emoji 🦙🚀 😶\u200d🌫️ ✅", "Ελληνικά and кириллица", "\u00a0non-breaking\u2003em space", "a\u0301 combining",
    "<|endoftext|>", "before<|endoftext|>after", "$$ @@ ## %% ^^ && ** (( )) [[ ]] {{ }}",
)


def verification_texts(max_chars: int = 4000, documents: int | None = None) -> list[str]:
    """Held-out texts (test-split documents, all by default, up to ``max_chars`` each) and the edge cases above."""
    from edge.core.data import Split, load_split

    docs = [d.text[:max_chars] for d in load_split(Split.TEST)[:documents]]
    return [*docs, *EDGE_CASES]


def our_token_bytes(tokenizer_json: str | Path | dict[str, Any]) -> list[bytes]:
    """Bytes of every id of a GPT-2 byte-level ``tokenizer.json`` (added tokens: their text)."""
    tj = _as_json(tokenizer_json)
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    table = {i: bytes(to_byte[c] for c in tok) for tok, i in tj["model"]["vocab"].items()}
    table.update({t["id"]: t["content"].encode("utf-8") for t in tj.get("added_tokens", [])})
    return [table.get(i, b"") for i in range(max(table) + 1)]


def verify_tokenizer(model_dir: str | Path, gguf: str | Path | LlamaCppPeer,
                     texts: Sequence[str] | None = None) -> int:
    """Check that llama.cpp's tokenizer from the GGUF is ours: the same bytes for every id, and the
    same ids for held-out texts (``<|endoftext|>`` special on both sides, llama.cpp ``special=True``).

    Args:
        model_dir: the HF folder whose ``tokenizer.json`` is ours.
        gguf: the converted file, or a peer already holding it.
        texts: defaults to :func:`verification_texts`.
    Returns:
        the number of texts checked.
    Raises:
        TokenizerMismatch: naming the first id whose bytes differ, or the first text and position
            where the ids differ.
    """
    from edge.model.tokenizer import load_tokenizer

    ours = load_tokenizer(model_dir)
    opened = isinstance(gguf, (str, Path))
    peer = LlamaCppPeer(gguf, threads=1) if opened else gguf
    try:
        pieces = our_token_bytes(Path(model_dir) / "tokenizer.json")
        if peer.vocab_size != len(pieces):
            raise TokenizerMismatch(f"llama.cpp's vocabulary has {peer.vocab_size} tokens, ours {len(pieces)}")
        for i, want_piece in enumerate(pieces):
            if peer.piece(i, special=True) != want_piece:
                raise TokenizerMismatch(f"token {i} is {want_piece!r} in {model_dir}/tokenizer.json but "
                                        f"{peer.piece(i, special=True)!r} in llama.cpp's vocabulary")
        texts = verification_texts() if texts is None else list(texts)
        for k, text in enumerate(texts):
            want = ours.encode(text).ids
            got = peer.tokenize(text, special=True)
            if got != want:
                i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                ctx = ours.decode(want[max(0, i - 3):i + 3], skip_special_tokens=False)
                raise TokenizerMismatch(
                    f"llama.cpp tokenizes text {k} ({text[:40]!r}...) differently from {model_dir}/tokenizer.json: "
                    f"first difference at token {i}: ours {want[i:i + 5]} vs llama.cpp {got[i:i + 5]} "
                    f"(around {ctx!r})")
        return len(texts)
    finally:
        if opened:
            peer.close()
