"""The host's request types: what callers hand :class:`edge.runtime.host.EngineHost` and get back
(its configuration, a generation request, the chunks of its answer, a refusal), and the host's own
record of a request while it is live.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from edge.core.errors import ConfigError, SmartExitError
from edge.runtime.audit import AuditConfig
from edge.runtime.engine_config import EngineConfig
from edge.runtime.settings import SLA_TPOT_MS, SLA_TTFT_MS


@dataclass
class HostConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_waiting: int = 64  # requests queued for admission; one more is refused as overloaded
    default_sla_ttft_ms: float = SLA_TTFT_MS.default  # a request that names no SLA gets these
    default_sla_tpot_ms: float = SLA_TPOT_MS.default
    audit: AuditConfig = field(default_factory=AuditConfig)
    control_timeout_s: float = 10.0
    # a JSONL file the engine thread appends one line per step to (what the step did and how long it
    # took under the stack): `smartexit profile` fits the served engine's step time from it
    # (scheduler/loadtest/serving_steps.py). None: no log (the default; it costs the engine thread ~20 us a step)
    step_log: str | None = None
    shed_late: bool = False  # refuse a waiting request once its TTFT deadline has passed (edge/runtime/host.py)

    def __post_init__(self) -> None:
        if isinstance(self.engine, dict):
            self.engine = EngineConfig(**self.engine)
        if isinstance(self.audit, dict):
            self.audit = AuditConfig.from_dict(self.audit, "host.audit")
        if self.max_waiting < 1:
            raise ConfigError(f"host.max_waiting must be >= 1, got {self.max_waiting}")
        SLA_TTFT_MS.check(self.default_sla_ttft_ms, "host", "default_sla_ttft_ms")
        SLA_TPOT_MS.check(self.default_sla_tpot_ms, "host", "default_sla_tpot_ms")


@dataclass
class GenRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    mode: str = "bounded"
    sla_ttft_ms: float | None = None
    sla_tpot_ms: float | None = None


@dataclass
class Chunk:
    request_id: str
    tokens: list[int]
    exit_layers: list[int]
    finish_reason: str | None = None  # set on the last chunk of a request
    retry_after_s: float | None = None  # with finish reason "shed": when to come back


def merge_chunks(chunks: list[Chunk]) -> list[Chunk]:
    """Chunks waiting to be sent, one per request in order of first appearance: each request's tokens
    concatenated in order, finished if any of them is (a transport that fell behind the engine sends
    fewer, larger responses instead of queueing one per step)."""
    merged: dict[str, Chunk] = {}
    for c in chunks:
        m = merged.get(c.request_id)
        if m is None:
            merged[c.request_id] = Chunk(c.request_id, list(c.tokens), list(c.exit_layers), c.finish_reason,
                                         c.retry_after_s)
        elif m.finish_reason is None:
            m.tokens += c.tokens
            m.exit_layers += c.exit_layers
            m.finish_reason, m.retry_after_s = c.finish_reason, c.retry_after_s
    return list(merged.values())


class HostError(SmartExitError):
    """A refused request: ``code`` is ``invalid_request`` (``field`` names the field), ``overloaded``
    (``retry_after_s`` says when to come back) or ``internal``."""

    def __init__(self, code: str, message: str, field: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.code, self.message, self.field, self.retry_after_s = code, message, field, retry_after_s

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "field": self.field, "retry_after_s": self.retry_after_s}


@dataclass
class LiveRequest:
    """The host's record of a request from its submission to its last chunk (only the engine thread
    touches it)."""
    req: GenRequest
    emit: Callable[[Chunk], None]
    arrival: float
    sla_ttft_s: float
    sla_tpot_s: float
    audited: bool  # eligible for the audit (greedy, bounded)
    # with the engine's verdicts, the request as a unit of the audit's per-request test: its exits, those judged
    # (by a verdict or a re-decode) or given up on (a re-decode dropped), and the false ones among them
    exits: int = 0
    resolved: int = 0
    false: int = 0
    incomplete: bool = False
    counted: bool = False  # its unit recorded
    engine_id: int = -1
    n_tokens: int = 0
    predicted: float | None = None  # EMA of its exit layers
    tokens: list[int] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)
    finish: str | None = None
    history: list[int] = field(default_factory=list)  # prompt + output, for audit prefixes
    first: float | None = None  # when its first token was handed over
    late: bool = False  # a token was handed over after its due time
    shed: bool = False  # refused while waiting: its TTFT deadline passed (HostConfig.shed_late)
    retry_after_s: float | None = None
