"""How the portable graphs are exported (:class:`ExportConfig`: opset, trace shapes, external data, which
ONNX Runtime graphs to add) and the limits it is checked against."""
from __future__ import annotations

from dataclasses import dataclass, field

from edge.core.errors import ConfigError

SUPPORTED_OPSETS = (17, 18)
# Protobuf's hard limit: one ModelProto cannot exceed 2 GiB, larger weights go to external data.
PROTOBUF_LIMIT = 2**31
MAX_VERIFY_BATCH = 64  # largest batch a verify graph is written for (each sequence is an attention node per layer)


@dataclass
class ExportConfig:
    """How to export (opset, trace shapes, when to use external data)."""

    opset: int = 17
    # Dummy shapes for tracing: distinct and > 1 so the exporter cannot fold B, T or P into constants.
    trace_batch: int = 2
    trace_seq: int = 3
    trace_past: int = 5
    # Graphs whose weights exceed this many bytes are saved with one external data file.
    external_data_threshold: int = PROTOBUF_LIMIT - (64 << 20)
    slim: bool = True  # simplify the portable graphs with onnxslim (see onnx_files.py slim_graphs)
    # the fused graph of every layer ("full"): what a call in which no row may leave runs (prompt chunks,
    # batches above the exit limit), one call instead of one per segment and no check. It holds a second
    # copy of the layers and the embedding table: off for a model whose weights the device cannot hold twice
    full_graph: bool = True
    # batch sizes that get a graph of every layer verifying several sequences' drafts in one call
    # (exporters/ort_fused.py ``verify_{B}``: mode exact speculates at those batch sizes, where the cost model
    # and the measured iterations say it pays). Each holds another copy of the layers, loaded only when used;
    # [] for none. 2 by default: on a 2-core CPU batch 4 and 8 measured no gain (docs/runtime.md); where a
    # decode step is bound by reading the weights (a GPU), larger batches are worth a graph
    verify_batches: list[int] = field(default_factory=lambda: [2])

    def __post_init__(self) -> None:
        if self.opset not in SUPPORTED_OPSETS:
            raise ConfigError(f"export.opset must be one of {SUPPORTED_OPSETS} (TensorRT-friendly), got {self.opset}")
        for name in ("trace_batch", "trace_seq", "trace_past"):
            if getattr(self, name) < 2:
                raise ConfigError(f"export.{name} must be >= 2 so the axis stays dynamic, got {getattr(self, name)}")
        if len({self.trace_batch, self.trace_seq, self.trace_past}) != 3:
            raise ConfigError("export.trace_batch, trace_seq and trace_past must differ (else the tracer may tie them)")
        if (not isinstance(self.verify_batches, (list, tuple))
                or not all(isinstance(b, int) and not isinstance(b, bool) and 2 <= b <= MAX_VERIFY_BATCH
                           for b in self.verify_batches) or len(set(self.verify_batches)) != len(self.verify_batches)):
            raise ConfigError(f"export.verify_batches must be a list of distinct batch sizes in 2..{MAX_VERIFY_BATCH}, "
                              f"got {self.verify_batches!r}")
        self.verify_batches = sorted(self.verify_batches)

