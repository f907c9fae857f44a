"""A generation's text as it streams, pure: token ids in, text deltas out (incremental detokenization that never
splits a character, stop strings that may span deltas, chat's leading-space trim)."""
from __future__ import annotations

from collections.abc import Callable, Sequence


class IncrementalDetokenizer:
    """Text deltas from a growing list of token ids.

    Decodes the ids from the last complete-character boundary (``prefix``) and emits only text past
    what was already emitted; a delta ending in U+FFFD (a UTF-8 sequence split across tokens) is held
    back until the next token completes it (the approach of HF text-generation-inference).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode, self._ids = decode, []
        self._prefix = self._read = 0

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """What is still held back (an incomplete character stays as U+FFFD)."""
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(before):]


class StopMatcher:
    """Cuts text at the first stop string; holds back a tail that may begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops, self._held, self.stopped = [s for s in stops if s], "", False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[:min(hits)]
        keep = max((k for s in self._stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        held, self._held = ("" if self.stopped else self._held), ""
        return held


class TextStream:
    """Token ids in, text deltas out: detokenization, stop strings, chat's leading-space trim."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str], lstrip: bool = False) -> None:
        self._detok, self._stop, self._lstrip = IncrementalDetokenizer(decode), StopMatcher(stop), lstrip
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def push(self, ids: Sequence[int]) -> str:
        return self._emit(self._stop.push(self._detok.push(ids)))

    def flush(self) -> str:
        return self._emit(self._stop.push(self._detok.flush()) + self._stop.flush())

    def _emit(self, text: str) -> str:
        if self._lstrip and not self.text:
            text = text.lstrip()
        self.text += text
        return text
