"""``smartexit bench serve``'s settings (:class:`BenchServeConfig`): the server or stack, the bundle, the
workload window, the SLA, the policies, the in-process run and the closed-loop capacity runs, checked when made."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edge.core.errors import ConfigError
from edge.runtime.settings import SLA_TPOT_MS, SLA_TTFT_MS

ARRIVALS = ("trace", "poisson", "bursty")


@dataclass
class BenchServeConfig:
    run_dir: str = "artifacts/demo"
    url: str | None = None            # a running server; None: start the stack for each policy
    api_key: str | None = None        # bearer key for ``url`` (never written to the artifacts)
    model: str | None = None          # the ``model`` field of each request; None: the server's (/v1/models)
    # the bundle `smartexit repo` wrote (exporters/triton.py): the in-process engine, the tokenizer and the
    # context window come from it; None: <run_dir>/triton/smartexit/1/bundle
    bundle: str | None = None
    tokenizer: str | None = None      # tokenizer.json for the prompts; None: the bundle's
    # workload: arrivals "trace" (``trace``, else the shared Azure trace, else synthetic Poisson at
    # rate_rps, reported as such), "poisson" or "bursty" (synthetic at rate_rps)
    trace: str | None = None
    arrivals: str = "trace"
    rate_rps: float = 2.0
    start_s: float = 0.0              # where the window opens, in trace (unscaled) seconds
    duration_s: float | None = 30.0   # seconds of arrivals after scaling
    max_requests: int | None = None
    time_scale: float = 1.0           # arrival (t - start_s) * time_scale
    context_window: int | None = None  # prompt + output tokens per request; None: the bundle's max positions
    max_output: int = 64
    prompt_percentile: float = 99.0   # this percentile of the trace's prompts maps to the prompt budget
    seed: int = 0
    # the SLA every request carries, and that attainment / goodput are counted against (default: the
    # server's; configs/bench_serve.yaml tightens it)
    sla_ttft_ms: float = SLA_TTFT_MS.default
    sla_tpot_ms: float = SLA_TPOT_MS.default
    mode: str = "bounded"
    policies: list[str] = field(default_factory=lambda: ["fixed", "aimd"])  # one served run each; the first heads the summary
    serve: dict[str, Any] = field(default_factory=dict)  # other keys for the stack's ServeConfig
    inprocess: bool = True
    threads: int | None = None        # in-process ONNX Runtime threads; None: the bundle's, as served
    host: dict[str, Any] = field(default_factory=dict)  # bundle host overrides (RepoConfig fields), in process
    warmup_requests: int = 2          # sent one by one before each run, not measured
    # the price of serving: closed-loop runs at these concurrencies (same requests, fixed lengths) on the
    # first policy's stack, straight to a tritonserver (hops) and in process, interleaved, capacity_repeats
    # times (scheduler/loadtest/capacity.py); tokens/s ratio at the highest and lowest, TTFT overhead at the lowest
    capacity_concurrency: list[int] = field(default_factory=lambda: [1, 8])
    capacity_repeats: int = 3
    capacity_requests: int = 16       # per concurrency level
    capacity_prompt_tokens: int = 64
    capacity_max_tokens: int = 32
    # the closed-loop runs once more with every request in mode exact (lossless speculative decoding),
    # through the stack: exact-mode tokens/s beside the bounded mode's
    capacity_exact: bool = True
    hops: bool = True                 # the closed-loop requests also straight to a tritonserver (no Ray Serve)
    # ... and to Triton's core in this process through its C API (no gRPC: scheduler/serving/triton_core.py),
    # which splits the Triton hop into gRPC's part and the core's and the model's stub's
    core_hop: bool = True
    # the processes of the first policy's stack stamp each request's way to its first token (scheduler/serving/
    # stamps.py, into <run_dir>/bench/stamps): serve.json's capacity.ttft_hops, where the TTFT overhead goes
    stamps: bool = True
    # after the first policy's run, a PNG of the live dashboard (/dashboard) of that stack in headless
    # Chromium -> bench/dashboard.png, embedded in the report (skipped, saying why, without a browser)
    screenshot: bool = True
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        from edge.runtime.request import Mode

        if self.arrivals not in ARRIVALS:
            raise ConfigError(f"bench serve: arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        try:
            self.mode = Mode(self.mode).value
        except ValueError:
            raise ConfigError(f"bench serve: mode must be one of {', '.join(m.value for m in Mode)}, "
                              f"got {self.mode!r}") from None
        if self.duration_s is None and self.max_requests is None:
            raise ConfigError("bench serve: set duration_s or max_requests (or both)")
        if (self.duration_s is not None and self.duration_s <= 0) or (self.max_requests is not None
                                                                       and self.max_requests < 1):
            raise ConfigError("bench serve: duration_s must be > 0 and max_requests >= 1")
        if self.rate_rps <= 0 or self.time_scale <= 0 or self.start_s < 0:
            raise ConfigError("bench serve: rate_rps > 0, time_scale > 0 and start_s >= 0 are required")
        SLA_TTFT_MS.check(self.sla_ttft_ms, "bench serve")
        SLA_TPOT_MS.check(self.sla_tpot_ms, "bench serve")
        if not self.policies and self.url is None:
            raise ConfigError("bench serve: policies is empty; name at least one (fixed, aimd)")
        if (self.threads is not None and self.threads < 1) or self.warmup_requests < 0 or self.request_timeout_s <= 0:
            raise ConfigError("bench serve: threads >= 1, warmup_requests >= 0 and request_timeout_s > 0")
        if any(c < 1 for c in self.capacity_concurrency) or self.capacity_requests < 1 \
                or self.capacity_prompt_tokens < 1 or self.capacity_max_tokens < 1 or self.capacity_repeats < 1:
            raise ConfigError("bench serve: capacity_concurrency values, capacity_requests, capacity_prompt_tokens, "
                              "capacity_max_tokens and capacity_repeats must be >= 1")
        if self.context_window is not None and self.context_window < 2:
            raise ConfigError(f"bench serve: context_window must be >= 2, got {self.context_window}")
