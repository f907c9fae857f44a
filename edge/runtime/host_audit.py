"""The host's side of the online false-exit audit (:mod:`edge.runtime.audit` keeps the estimate and its bounds).

With deferral the engine judges every early exit of a greedy ``bounded`` request itself (``Verdict``: the
full model's token, from the owed layers it computes anyway) and every token of such a request is counted;
otherwise a sampled token that exited early is re-decoded at full depth as a one-token request over the same
prefix (so is an exit the engine could not judge), submitted only while the engine has spare capacity
(nothing waiting, a free slot, one audit at a time), so it never delays a request's admission. When the
audit's bound crosses the certificate's epsilon (the threshold table's, handed to the host), later
``bounded`` requests run at full depth.

:class:`HostAudit` runs on the engine thread of :class:`edge.runtime.host.EngineHost`, as the rest of the
host's bookkeeping does.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge.core.errors import ConfigError
from edge.runtime.audit import AuditConfig, AuditEstimate, Trigger
from edge.runtime.engine import Engine
from edge.runtime.engine_config import KVMode
from edge.runtime.request import Mode, Request, TokenEvent, Verdict
from edge.runtime.host_types import LiveRequest
from edge.runtime.settings import EPSILON

log = logging.getLogger("smartexit.host")


def check_epsilon(a: AuditConfig, epsilon: float | None) -> None:
    """``epsilon`` within (0, 1), or None where nothing is audited.

    Raises:
        ConfigError: an audit (``a.fraction`` > 0) without ``epsilon``, or ``epsilon`` outside (0, 1).
    """
    if epsilon is not None:
        EPSILON.check(epsilon, "host")
    elif a.fraction > 0:
        raise ConfigError(f"host.audit.fraction={a.fraction}: the audit tests the certificate's epsilon, and "
                          f"none was given (EngineHost(epsilon=...): the threshold table's); set "
                          f"audit.fraction=0 for a rule without a certificate")


@dataclass
class AuditItem:
    prefix: list[int]
    token: int
    exit_layer: int
    live: LiveRequest | None = None  # the request it belongs to, where the request is a unit of the per-request test


class HostAudit:
    """What the host feeds the audit: served tokens, the engine's verdicts, re-decodes of exits it could not
    judge, and finished requests as units (module docstring)."""

    def __init__(self, cfg: AuditConfig, epsilon: float | None, kv_mode: KVMode, num_layers: int) -> None:
        """``epsilon``: the certificate's bound, checked by :func:`check_epsilon`.

        Raises:
            ConfigError: ``trigger=requests`` where requests are not audited whole.
        """
        self.cfg = cfg
        self.num_layers = num_layers
        # the engine judges every greedy exit itself (deferral's verdicts): the audit counts every token
        self.verdicts = cfg.verdicts and epsilon is not None and kv_mode is KVMode.DEFER
        trigger = cfg.trigger
        if trigger is Trigger.AUTO:  # requests as the units where requests are audited whole
            trigger = Trigger.REQUESTS if self.verdicts else Trigger.LOWER
        elif trigger is Trigger.REQUESTS and not self.verdicts and epsilon is not None:
            raise ConfigError("host.audit.trigger=requests needs requests audited whole (audit.verdicts with "
                              f"kv_mode defer; this host: verdicts={cfg.verdicts}, kv_mode "
                              f"{kv_mode.value}): use trigger=lower or auto")
        self.estimate = AuditEstimate(epsilon=epsilon, delta=cfg.delta, trigger=trigger, min_tokens=cfg.min_tokens)
        self._rng = np.random.default_rng(cfg.seed)
        self.queue: collections.deque[AuditItem] = collections.deque()
        self._inflight = False
        self.dropped = 0

    def eligible(self, ereq: Request) -> bool:
        """Whether a request is audited (greedy, bounded, and an audit on)."""
        return ereq.mode is Mode.BOUNDED and ereq.temperature == 0 and (self.cfg.fraction > 0 or self.verdicts)

    def on_token(self, live: LiveRequest, ev: TokenEvent) -> None:
        """A token of an audited request, served."""
        if self.verdicts:  # every token counts: an exit when its verdict comes (on_verdict)
            if ev.exit_layer >= self.num_layers:
                self._record(ev.exit_layer, False)
            else:
                live.exits += 1
        elif self._rng.random() < self.cfg.fraction:
            self._sample(live, ev)

    def _sample(self, live: LiveRequest, ev: TokenEvent) -> None:
        if ev.exit_layer >= self.num_layers:  # reached the last layer: cannot exit falsely
            self._record(ev.exit_layer, False)
        else:
            self._queue(AuditItem(list(live.history), ev.token, ev.exit_layer))

    def on_verdict(self, live: LiveRequest, v: Verdict) -> None:
        """The engine's verdict on one of ``live``'s exits; one it could not judge is re-decoded."""
        if v.false_exit is not None:
            self._record(v.exit_layer, v.false_exit)
            self._resolve(live, v.false_exit)
        else:  # its prefix: the prompt and the tokens before it (the host has them all by now)
            self._queue(AuditItem(live.history[:len(live.req.prompt) + v.index], v.token, v.exit_layer, live))

    def _queue(self, item: AuditItem) -> None:
        if len(self.queue) < self.cfg.max_pending:
            self.queue.append(item)
        else:
            self.dropped += 1
            if item.live is not None:
                self._resolve(item.live, None)

    def _resolve(self, live: LiveRequest, false_exit: bool | None) -> None:
        """One of ``live``'s exits judged (None: given up on, the request is no longer a whole unit)."""
        live.resolved += 1
        live.false += bool(false_exit)
        live.incomplete |= false_exit is None
        self.maybe_unit(live)

    def maybe_unit(self, live: LiveRequest) -> None:
        """A finished request whose every exit is judged: its false-exit rate over its judged tokens (all but
        the first, which the prefill decides at full depth) is one unit of the audit's per-request test."""
        if (not (self.verdicts and live.audited and live.finish is not None and live.resolved == live.exits)
                or live.counted):
            return
        live.counted = True
        if live.incomplete:
            self.estimate.incomplete_units += 1
        elif live.n_tokens >= 2 and self.estimate.record_unit(live.false / (live.n_tokens - 1)):
            self._fired()

    def _record(self, exit_layer: int, false_exit: bool) -> None:
        if self.estimate.record(exit_layer, false_exit):
            self._fired()

    def _fired(self) -> None:
        log.warning("false-exit audit: the rate exceeds epsilon=%.4g (%s); bounded requests now run at "
                    "full depth", self.estimate.epsilon, self.estimate.as_dict())

    def maybe_submit(self, e: Engine, inbox_pending: bool) -> None:
        """Submit the next re-decode where the engine has spare capacity (nothing waiting, nothing in the
        host's inbox, a free slot, below its admission limit, no audit in flight)."""
        if (not self.queue or self._inflight or e.waiting or inbox_pending
                or e.cache.free_slots == 0 or len(e.prefilling) + len(e.decoding) >= e.cfg.max_running):
            return
        item = self.queue.popleft()
        self._inflight = True

        def verdict(ev: TokenEvent, item: AuditItem = item) -> None:
            if ev.finished:
                self._inflight = False
            if ev.token >= 0:
                self._record(item.exit_layer, ev.token != item.token)
            if item.live is not None and ev.finished:  # its request's unit: judged, or (no token) given up on
                self._resolve(item.live, ev.token != item.token if ev.token >= 0 else None)

        e.submit(Request(item.prefix, 1, mode=Mode.FULL, on_token=verdict))

    def reset(self) -> None:
        """Start the audit over (the ``audit_reset`` op, :meth:`AuditEstimate.reset`), nothing left queued."""
        self.estimate.reset()
        self.queue.clear()

    def stats(self, verdict_counts: dict[str, int]) -> dict[str, Any]:
        """The estimate's figures with the host's: ``verdict_counts``, the engine's."""
        audit = self.estimate.as_dict()
        audit.update(fraction=self.cfg.fraction, pending=len(self.queue), dropped=self.dropped,
                     engine_verdicts=self.verdicts, verdict_counts=dict(verdict_counts))
        return audit
