"""An engine's configuration: cache slots and length, prefill budget, admission limit, the K/V mode of
skipped layers (:class:`KVMode`), where exits and drafts run; checked on construction."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from edge.core.errors import ConfigError
from edge.runtime.settings import MAX_RUNNING, MAX_SEQS, PREFILL_BUDGET
from edge.runtime.speculative import SpecConfig


class KVMode(str, enum.Enum):
    PROPAGATE = "propagate"
    DEFER = "defer"


@dataclass
class EngineConfig:
    max_seqs: int = MAX_SEQS.default  # cache slots
    max_len: int = 512  # tokens per sequence (prompt + output), <= the model's context window
    # prompt tokens per iteration; clamped to the backend's largest chunk (Backend.max_chunk)
    prefill_budget: int = PREFILL_BUDGET.default
    max_running: int = MAX_RUNNING.default  # admission limit (sequences holding a slot)
    kv_mode: KVMode = KVMode.PROPAGATE
    # With deferral, rows exit only while the decode batch holds at most this many sequences (None: any
    # batch). At batch 1 a sequence's deferred rows ride along with its next token in one call; at
    # batch > 1 they need a pass of their own over every later segment (ONNX Runtime's CPU attention
    # takes several rows with a past only at batch 1) and the rows still running sit in scattered
    # cache slots, so exits cost more than they skip (measured: 0.47x full depth at batch 16). Above
    # the limit every row runs to full depth: the K/V stays exact and no token exits falsely.
    defer_exit_max_batch: int | None = 1
    # With deferral, compute a leaving row's skipped layers in the same step instead of with its next token:
    # the row keeps running through the remaining segments (its later checks ignored) and emits its exit's
    # token. The K/V and the tokens are deferral's (every layer of every token computed exactly), without
    # deferral's extra calls over scattered slots at batch > 1; it saves nothing, so it is for free-running
    # calibration and evaluation only (calibration.freerun), never for serving.
    defer_inline: bool = False
    # Measure, per batch size, what a decode step that checks exits costs against one call of every layer,
    # and run the cheaper (edge/runtime/gate.py): exits never make a step dearer than full depth. The served
    # engine runs with it (exporters/triton.py, repo.exit_gate); off here, so that an engine does what its
    # rule says (calibration, the benches' exit systems, the tests).
    exit_gate: bool = False
    # Prefill the chunks of sequences in consecutive cache slots and of one length in one call (Engine.
    # _prefill_together) instead of one sequence per call: the same chunks and tokens (ONNX Runtime's logits
    # bit for bit, tests/unit/edge/runtime), fewer calls. For offline runs that admit many prompts at once
    # (calibration's units: run_batch); off for serving, whose step-time model prices a prefill per sequence
    # (scheduler/control/latency.py)
    prefill_together: bool = False
    speculative: SpecConfig = field(default_factory=SpecConfig)  # mode exact: draft exit, stop rule
    # Requests in mode bounded also take mode exact's context-lookup and corpus drafts wherever a round is
    # expected to pay (never exit drafts, never while deferred rows are owed): a verified round emits the
    # full model's tokens, as a full-depth step does, so what the certificate bounds stays the rule's
    # decisions on the steps that check (the step gate's argument, edge/runtime/gate.py). A bounded request
    # is then never slower than an exact one for want of drafts. The served engine runs with it
    # (exporters/triton.py, repo.bounded_drafts); off here, so that an engine does what its rule says.
    bounded_drafts: bool = False
    # Requests in mode exact speculate while the decode batch holds at most this many sequences (None: any
    # batch); above it they decode at full depth, which is lossless too. ONNX Runtime's CPU attention
    # verifies several rows of a sequence only at batch 1, so a batch verifies sequence by sequence.
    speculate_max_batch: int | None = 1

    def __post_init__(self) -> None:
        self.kv_mode = KVMode(self.kv_mode)
        if isinstance(self.speculative, dict):
            self.speculative = SpecConfig(**self.speculative)
        if self.speculate_max_batch is not None and self.speculate_max_batch < 1:
            raise ConfigError(f"engine.speculate_max_batch must be >= 1 or None, got {self.speculate_max_batch}")
        for setting in (MAX_SEQS, PREFILL_BUDGET, MAX_RUNNING):
            setting.check(getattr(self, setting.name), "engine")
        if self.max_len < 2:
            raise ConfigError(f"engine.max_len must be >= 2, got {self.max_len}")
        if self.defer_exit_max_batch is not None and self.defer_exit_max_batch < 1:
            raise ConfigError(f"engine.defer_exit_max_batch must be >= 1 or None, got {self.defer_exit_max_batch}")
