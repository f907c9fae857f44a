"""The settings of ``smartexit bench energy`` (:mod:`edge.pipeline.bench.energy`), checked as they are read, and
the names of the systems it measures."""
from __future__ import annotations

from dataclasses import dataclass

from edge.core.errors import ConfigError

FULL, EXITS, C_FULL, C_EXITS = "full", "exits", "compressed_full", "compressed_exits"
# the shipped graphs and rule as the served engine runs them: the step gate (exits only where checking steps measured
# cheaper than full depth) and bounded requests' lossless lookup / corpus drafts (EngineConfig.bounded_drafts)
SERVED = "served"


@dataclass
class EnergyBenchConfig:
    run_dir: str = "artifacts/demo"
    meter: str = "auto"  # auto | jtop | tegrastats | nvml | rapl | none (edge.energy.detect.MeterKind)
    interval_s: float = 0.05  # power sampling interval
    idle_seconds: float = 1.0  # idle baseline window before each repeat (0: none)
    batch: int = 1  # sequences decoded together
    prompts: int = 4  # prompts per window (in groups of ``batch``)
    prompt_tokens: int = 64
    new_tokens: int = 32
    repeats: int = 3
    threads: int = 2
    seed: int = 0
    backend: str = "onnxruntime"  # or served | tensorrt | torch_static | onnxruntime_portable (module docstring)
    device: str | None = None  # torch_static's (default: cuda where there is one)
    dtype: str = "float32"  # torch_static's

    def __post_init__(self) -> None:
        from edge.runtime.served import SERVED_BACKENDS

        if self.backend not in ("served", *SERVED_BACKENDS):
            raise ConfigError(f"bench energy: backend {self.backend!r} is not served or one of "
                              f"{', '.join(SERVED_BACKENDS)}")
        if self.interval_s <= 0 or self.idle_seconds < 0:
            raise ConfigError("bench energy: interval_s > 0 and idle_seconds >= 0 are required")
        if min(self.batch, self.prompts, self.prompt_tokens, self.repeats) < 1 or self.new_tokens < 2:
            raise ConfigError("bench energy: batch, prompts, prompt_tokens, repeats >= 1 and new_tokens >= 2 "
                              "are required")
        if self.prompts % self.batch:
            raise ConfigError(f"bench energy: prompts ({self.prompts}) must be a multiple of batch ({self.batch})")
