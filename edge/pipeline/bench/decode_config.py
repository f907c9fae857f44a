"""The settings of ``smartexit bench decode`` (:mod:`edge.pipeline.bench.decode`), checked as they are read."""
from __future__ import annotations

from dataclasses import dataclass, field

from edge.core.errors import ConfigError
from edge.runtime.engine_config import KVMode
from edge.runtime.speculative import StopRule


TRANSFORMERS_PEERS = ("hf", "layerskip", "hf_lookup")  # the systems ``peer_repeats`` counts the repeats of


@dataclass
class DecodeBenchConfig:
    run_dir: str = "artifacts/demo"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    prompt_tokens: int = 64
    new_tokens: int = 32
    warmup: int = 1
    repeats: int = 3
    # measured repeats of the transformers peers (a), (b) and their prompt lookup (``TRANSFORMERS_PEERS``), each
    # after ``warmup``, interleaved with the others' first repeats; None: ``repeats``. They decode 10-20x slower than
    # the engine, so at 3 repeats they were ~19 of the decode bench's ~80 s in the demo (2-core AMD EPYC VM), and
    # the goals that read them stand 3-10x past their lines (``speedup_exit_vs_hf_b1`` 11.3 against 3)
    peer_repeats: int | None = None
    layerskip_exit: int = 6
    batch1_prompts: int = 4  # batch 1 runs this many prompts one after another (one prompt says little)
    threads: int = 2
    memory: bool = True
    seed: int = 0
    # which exit system is (d) (both are measured): "table" = the K/V mode the threshold table's
    # certificate covers (calibration chose it); naming a mode measures that one as (d), uncertified
    kv_mode: str = "table"
    overhead_spans: int = 4  # segment-cost row: this many chained layer spans vs one call
    # what a check costs (edge/pipeline/bench/decision.py): repeats of 50 interleaved calls per chain, the
    # median of within-repeat differences
    decision_repeats: int = 15
    # (e) self-speculative decoding: the draft exit (None: the engine's default, the first decision exit),
    # the draft-length rule, and whether to sweep the rules and draft exits at batch 1, with how many
    # paired repeats (after ``warmup``): a run at batch 1 takes ~0.3 s, and single pairs vary by ~15%
    draft_exit: int | None = None
    spec_stop: str = "calibrated"
    spec_sweep: bool = True
    spec_sweep_repeats: int = 5
    # warm-up rounds of the sweep before its repeats (None: ``warmup``). The sweep runs after the batch
    # comparisons, on backends every system has already run on (call shapes bound, caches warm)
    spec_sweep_warmup: int | None = None
    # (e) speculates while the decode batch holds at most this many sequences, as the engine's
    # EngineConfig.speculate_max_batch (its default, 1: a larger batch decodes exact requests at full
    # depth); null measures speculation at every batch size
    speculate_max_batch: int | None = 1
    spec_ceiling: bool = True  # the self-speculation ceiling at batch 1 (edge/pipeline/bench/spec_ceiling.py)
    # (e) against (c) at these batch sizes besides ``batch_sizes`` (the two systems only, paired), each with
    # the export's verify graph where it has one (export.verify_batches), else the per-row path. None: each
    # verify-graph size not in batch_sizes; [] none
    spec_verify_batches: list[int] | None = None
    # (e) against (c) at each of ``batch_sizes``: this many more paired repeats after the rows' own (the two systems
    # only, adjacent, their order alternating), pooled with them into (e)/(c) (``speculative_pairs``: how many). A
    # run of 4 prompts at batch 1 takes ~0.2 s, and with 3 pairs the demo's (e)/(c) read 1.02-1.63 on one set of
    # graphs and prompts where 20 pairs read 1.40 and 1.41 (docs/runtime.md)
    spec_extra_pairs: int = 0

    def repeats_of(self, system: str) -> int:
        """Measured repeats of ``system`` at each batch size (before any extra pairs)."""
        if system in TRANSFORMERS_PEERS and self.peer_repeats is not None:
            return self.peer_repeats
        return self.repeats

    def __post_init__(self) -> None:
        try:
            self.spec_stop = StopRule(self.spec_stop).value
        except ValueError:
            raise ConfigError(f"bench.spec_stop must be one of {', '.join(r.value for r in StopRule)}, "
                              f"got {self.spec_stop!r}") from None
        if self.kv_mode != "table":
            try:
                self.kv_mode = KVMode(self.kv_mode).value
            except ValueError:
                raise ConfigError(f"bench.kv_mode must be 'table', 'defer' or 'propagate', got {self.kv_mode!r}") from None
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError("bench.batch_sizes must be a non-empty list of positive sizes")
        if self.repeats < 1 or self.new_tokens < 2 or self.prompt_tokens < 1:
            raise ConfigError("bench: repeats >= 1, new_tokens >= 2 and prompt_tokens >= 1 are required")
        if self.peer_repeats is not None and not 1 <= self.peer_repeats <= self.repeats:
            raise ConfigError(f"bench.peer_repeats must be in [1, repeats={self.repeats}] or null, "
                              f"got {self.peer_repeats}")
        if self.spec_sweep_repeats < 1:
            raise ConfigError(f"bench.spec_sweep_repeats must be >= 1, got {self.spec_sweep_repeats}")
        if self.spec_sweep_warmup is not None and self.spec_sweep_warmup < 0:
            raise ConfigError(f"bench.spec_sweep_warmup must be >= 0 or null, got {self.spec_sweep_warmup}")
        if self.spec_extra_pairs < 0:
            raise ConfigError(f"bench.spec_extra_pairs must be >= 0, got {self.spec_extra_pairs}")
        if self.decision_repeats < 1:
            raise ConfigError(f"bench.decision_repeats must be >= 1, got {self.decision_repeats}")
        if self.spec_verify_batches is not None and (
                not isinstance(self.spec_verify_batches, list)
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 2 for b in self.spec_verify_batches)):
            raise ConfigError(f"bench.spec_verify_batches must be null or a list of batch sizes >= 2, "
                              f"got {self.spec_verify_batches!r}")
