"""``smartexit bench decode``: decode throughput of SmartExit against the peers, side by side.

Systems, on the same weights and the same held-out prompts (equal length, no padding):
  hf           (a) transformers ``generate``, full model, greedy;
  layerskip    (b) transformers ``generate(assistant_early_exit=k)``: LayerSkip-style lossless
                   self-speculation (Elhoushi et al. 2024); transformers supports batch 1 only;
  engine_full  (c) the SmartExit engine on ONNX Runtime at full depth: the fused graph of the same
                   decoder without exit heads (``onnx_full``), so no exit overhead is charged;
  engine_exit_propagate, engine_exit_defer
               (d) the same engine with the calibrated threshold table, skipped layers' K/V by
                   state propagation or by deferred recomputation; both are measured, and
                   ``kv_mode`` names the one reported as (d) (the other is (d'));
  engine_speculative
               (e) the same engine on the exits export, requests in mode ``exact``: lossless
                   self-speculative decoding from a draft exit, at every batch size (its tokens must be
                   (c)'s: counted as mismatches); a sweep at batch 1 compares its draft-length rules and
                   draft exits (:mod:`edge.pipeline.bench.speculation`);
  llamacpp     (f) llama.cpp, when installed, at the precision of the served model (f32 for a float
               run, q8_0 for the shipped INT8 model: llamacpp_gguf.same_precision_type), batch 1, through
               its Python API, and llama.cpp's own ``llama-bench`` loop where it is built; decode and
               prefill are timed apart, and the speed-ups over llama.cpp compare decode alone (our decode
               time: the gaps between a sequence's tokens) against the faster of the two rows.
Per batch size: warm-up runs, then repeats in which the systems run interleaved (rotated
order); ratios are computed repeat by repeat and their median reported. Tokens/s counts
generated tokens over the whole ``generate`` call (prefill included, the same for all).
Token latencies are the gaps between generated tokens, each timestamped as it arrives
(LayerSkip's tokens of one verification step arrive together). False exits are checked as
calibration checks them (:func:`calibration.freerun.check_continuations`).
Peak resident memory is measured per system in a fresh subprocess.

Also measured: what segmenting costs by itself (k chained layer-span calls against one call,
:mod:`edge.pipeline.bench.segments`), and (d)/(c) against its ceiling: layers / mean layers *computed* per
token, counting what the K/V mode recomputes (propagation: the skipped layers' K/V projections;
deferral: every skipped layer, run later with the next token).
"""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from calibration.table import TableRule, load_table
from edge.core.artifacts import Manifest, atomic_write_json, publish_files
from edge.pipeline.bench.summary import SYSTEMS, goals, headline, plot, render_markdown, summary_lines
from edge.runtime.backend import make_backend
from edge.runtime.engine import KVMode, Mode, held_step_gate
from edge.runtime.profile import ProfiledBackend, ProfiledRule
from edge.runtime.rules import NeverExit
from edge.runtime.speculative import Source, SpecConfig, StopRule
from edge.core.errors import ConfigError, SmartExitError
from edge.compress.apply import precision_of
from edge.compress.checkpoint import load_served
from edge.model.exits import MultiExitModel
from edge.pipeline.bench.decision import decision_cost
from edge.pipeline.bench.segments import segment_call_overhead
from edge.runtime.graphs import FUSED_DIR
from edge.pipeline.bench.spec_ceiling import agreement_trace, ceiling as spec_ceiling, measure_costs
from edge.pipeline.bench.engine_memory import vm_kib
from edge.runtime.batch import RunResult, run_batch
from edge.pipeline.run import open_run
from edge.pipeline.bench.quiesce import settle
from edge.pipeline.bench.speculation import (calibrated_vs_best_other, distinct, divergences, pool_stats,
                                             speculative_sweep, verify_cost_ratios,
                                             sweep_variants, token_mismatches)
from calibration.freerun import Served, check_continuations

STAGE = "bench_decode"
def exit_system(mode: KVMode | str) -> str:
    return f"engine_exit_{KVMode(mode).value}"


@dataclass
class DecodeBenchConfig:
    run_dir: str = "artifacts/demo"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    prompt_tokens: int = 64
    new_tokens: int = 32
    warmup: int = 1
    repeats: int = 3
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


# ------------------------------------------------------------------ systems
class TokenStamps:
    """transformers streamer that records when each generated token arrives.

    ``generate`` first puts the prompt [B, P], then what each step makes: greedy decoding one token
    per sequence ([B]), assisted decoding (LayerSkip self-speculation, batch 1) the tokens a
    verification step accepted ([1, k]), which arrive together: k arrivals at one time.
    """

    def __init__(self) -> None:
        self.arrivals: list[float] = []  # one time per generated token (per sequence: one per step)
        self._prompt = True

    def put(self, value) -> None:
        now = time.perf_counter()
        if self._prompt:  # the prompt, put before the prefill
            self._prompt = False
            return
        self.arrivals += [now] * (value.shape[-1] if value.dim() == 2 else 1)

    def end(self) -> None:
        pass

    def gaps(self) -> list[float]:
        """Seconds between consecutive generated tokens: 0 within a burst of assisted decoding."""
        return np.diff(self.arrivals).tolist()


HF_LOOKUP_TOKENS = 10  # transformers' prompt_lookup_num_tokens (its documented example's value)


def run_hf(model, prompts: list[list[int]], n: int, early_exit: int | None = None,
           prompt_lookup: int | None = None) -> RunResult:
    from transformers import GenerationConfig

    ids = torch.tensor(prompts)
    stamps = TokenStamps()
    gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                           eos_token_id=None, assistant_early_exit=early_exit,
                           prompt_lookup_num_tokens=prompt_lookup)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen, streamer=stamps)
    seconds = time.perf_counter() - t0
    return RunResult(out[:, len(prompts[0]):].tolist(), None, seconds, stamps.gaps())


def run_groups(fn, groups: list[list[list[int]]], n: int) -> RunResult:
    """Run ``fn(prompts, n)`` on each group in turn and pool the results."""
    parts = [fn(g, n) for g in groups]
    return RunResult([t for p in parts for t in p.tokens],
                     None if parts[0].exit_layers is None else [e for p in parts for e in p.exit_layers],
                     sum(p.seconds for p in parts), [g for p in parts for g in p.token_latencies],
                     [d for p in parts for d in p.spec_stats], [d for p in parts for d in p.source_stats])


class Systems:
    """Loads every system once; ``run(name, prompts, n)`` generates with it."""

    def __init__(self, cfg: DecodeBenchConfig, ckpt: Path, graphs: Path, graphs_full: Path, thresholds: Path,
                 model: MultiExitModel | None, only: tuple[str, ...] = SYSTEMS, precision: str | None = None) -> None:
        """``model``: the served model (None where only peers run); ``precision``: its precision
        (:func:`precision_of`), given where ``model`` is None and llama.cpp runs."""
        import transformers

        self.cfg = cfg
        self.loaded = set(only) - {"llamacpp", "llamacpp_lookup"}
        self.llamacpp_skipped: str | None = None
        self.llama_bench_skipped: str | None = "llama.cpp not loaded"
        transformers.logging.set_verbosity_error()
        # transformers, LayerSkip and llama.cpp run the float weights the run distilled (a compressed run's
        # checkpoint holds quantized layers they cannot load): "the same weights" in f32
        source = Manifest(cfg.run_dir).verified_output("distill", "checkpoint")
        if "llamacpp" in only or "llamacpp_lookup" in only:
            self._load_llamacpp(source, precision if precision is not None else precision_of(model))
        if {"hf", "layerskip", "hf_lookup"} & set(only):
            self.hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        if "engine_full" in only:
            self.full_backend = make_backend("onnxruntime", graphs_dir=graphs_full, checkpoint=ckpt,
                                             threads=cfg.threads)
        if {"engine_exit_propagate", "engine_exit_defer", "engine_exit_gated", "engine_speculative"} & set(only):
            self.backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=cfg.threads)
            self.table_rule = TableRule(load_table(thresholds, ckpt))
            self.gated_mode = KVMode(self.table_rule.table.kv_mode)  # (d)-gated's K/V mode: the bench sets (d)'s
        self.spec = SpecConfig(draft_exit=cfg.draft_exit, stop=cfg.spec_stop)  # (e)'s settings

    def _load_llamacpp(self, ckpt: Path, precision: str) -> None:
        """The peer (f), if llama-cpp-python is installed (``make llamacpp``): the float checkpoint converted
        to GGUF by the converter of llama.cpp's own source distribution (its tokenizer checked against
        ours), quantized by llama.cpp to the served model's precision (q8_0 for W8A8); and whether its
        ``llama-bench`` is built."""
        from edge.pipeline.bench import llamacpp, llamacpp_bench, llamacpp_gguf, llamacpp_tokenizer

        self.llamacpp_skipped = llamacpp.available()
        if self.llamacpp_skipped is not None:
            return
        try:
            self.peer_type = llamacpp_gguf.same_precision_type(precision)
        except ConfigError as exc:
            self.llamacpp_skipped = str(exc)
            return
        f32 = llamacpp_gguf.cached_gguf(self.cfg.run_dir, ckpt, "f32")
        llamacpp_tokenizer.verify_tokenizer(ckpt, f32)
        self.gguf = llamacpp_gguf.same_precision_gguf(self.cfg.run_dir, ckpt, precision, self.cfg.threads)
        try:  # repacked weights where they run (llamacpp.repack_runs); a peer that cannot decode is skipped
            self.peer = llamacpp.LlamaCppPeer(self.gguf, self.cfg.threads)
        except SmartExitError as exc:
            self.llamacpp_skipped = str(exc)
            return
        self.peer_lookup = llamacpp.LlamaCppLookupPeer(self.gguf, self.cfg.threads, repack=self.peer.repack)
        self.llama_bench_skipped = llamacpp_bench.llama_bench_unavailable()
        self.loaded |= {"llamacpp", "llamacpp_lookup"}

    def llama_bench(self, n: int):
        """One llama-bench measurement (prefill, then the decode steps after a prompt) of the peer's GGUF."""
        from edge.pipeline.bench.llamacpp_bench import llama_bench_speed

        return llama_bench_speed(self.gguf, self.cfg.prompt_tokens, n, self.cfg.threads, repeats=1,
                                 repack=self.peer.repack)

    def run(self, name: str, prompts: list[list[int]], n: int, backend=None, rule=None,
            group: int | None = None, spec: SpecConfig | None = None) -> RunResult:
        """Generate with system ``name``; prompts run ``group`` at a time (default: all at once);
        ``spec``: (e)'s settings for this run (default: the benchmark's)."""
        group = group or len(prompts)
        if group < len(prompts):
            return run_groups(lambda g, k: self.run(name, g, k, backend, rule, spec=spec), [
                prompts[i:i + group] for i in range(0, len(prompts), group)], n)
        if name == "hf":
            return run_hf(self.hf, prompts, n)
        if name == "layerskip":
            return run_hf(self.hf, prompts, n, early_exit=self.cfg.layerskip_exit)
        if name == "hf_lookup":
            return run_hf(self.hf, prompts, n, prompt_lookup=HF_LOOKUP_TOKENS)
        if name == "engine_full":
            return run_batch(self.full_backend, NeverExit(), prompts, n, KVMode.PROPAGATE)
        if name in ("llamacpp", "llamacpp_lookup"):
            t = (self.peer if name == "llamacpp" else self.peer_lookup).generate_timed(prompts[0], n)
            return RunResult([list(t.tokens)], None, t.prefill_seconds + t.decode_seconds, list(t.token_latencies))
        if name == "engine_speculative":  # the engine's K/V mode is unused: exact requests never exit early
            return run_batch(backend or self.backend, rule or self.table_rule, prompts, n, KVMode.PROPAGATE,
                             spec=spec or self.spec, speculate_max_batch=self.cfg.speculate_max_batch)
        if name == "engine_exit_gated":  # (d) as the served engine runs it: checks where they measured cheaper,
            # lookup and corpus drafts where a round pays
            return run_batch(backend or self.backend, rule or self.table_rule, prompts, n, self.gated_mode,
                             exit_gate=True, spec=spec or self.spec, mode=Mode.BOUNDED, bounded_drafts=True,
                             speculate_max_batch=self.cfg.speculate_max_batch)
        mode = KVMode(name.removeprefix("engine_exit_"))
        return run_batch(backend or self.backend, rule or self.table_rule, prompts, n, mode)


def applicable(name: str, batch: int) -> bool:
    # transformers' assisted generation and prompt lookup need batch 1; llama.cpp is measured as a batch-1 decoder
    return not (name in ("layerskip", "llamacpp", "hf_lookup", "llamacpp_lookup") and batch > 1)


# ------------------------------------------------------------------ measurement
def false_exits(served: Served, prompts: list[list[int]], res: RunResult, mode: KVMode) -> tuple[int, int]:
    """(wrong tokens, judged tokens) of an engine run: the tokens that differ from the full model's greedy
    choice on the same prefix, by calibration's check (:func:`calibration.freerun.check_continuations`);
    ``Served(backend)``: the full model is that backend at full depth (what calibration certifies)."""
    r = check_continuations(served, np.asarray(prompts), np.asarray(res.tokens), np.asarray(res.exit_layers),
                            mode).summary()
    return r.false_exits + r.full_depth_mismatches, r.tokens


def gate_share(systems: Systems, b: int) -> float | None:
    """The share of (d)-gated's decode steps at batch ``b`` that its step gate let check exits (None: the gated
    system did not run, or no step could check)."""
    if "engine_exit_gated" not in systems.loaded:
        return None
    gate = held_step_gate(systems.backend, systems.gated_mode, systems.table_rule)
    return None if gate is None else gate.share_checked(b)


def _token_match(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two systems' greedy tokens agree (a missing token disagrees)."""
    bad, total = token_mismatches(a, b)
    return 1.0 - bad / max(1, total)


def kv_fraction(model: MultiExitModel) -> float:
    """Share of a decoder layer's multiply-adds that its K/V projections are (what propagation
    computes for a skipped layer): 2 D KV hd over D (H hd) + 2 D KV hd + (H hd) D + 3 D F."""
    c = model.backbone.cfg
    kv = 2 * c.hidden_size * c.num_kv_heads * c.head_dim
    return kv / (2 * c.hidden_size * c.num_heads * c.head_dim + kv + 3 * c.hidden_size * c.intermediate_size)


def layers_computed(exit_layers: list[int], num_layers: int, mode: KVMode, kv_frac: float) -> float:
    """Mean layers computed per token, recomputation counted: a token that exits at layer k runs k
    layers, then (propagate) the K/V projections of the skipped ones or (defer) all of them later."""
    e = np.asarray(exit_layers, np.float64)
    skipped = num_layers - e
    return float(np.mean(e + (kv_frac * skipped if KVMode(mode) is KVMode.PROPAGATE else skipped)))


def summarise(runs: dict[str, list[RunResult]], sequences: int, n: int,
              repeats: int | None = None) -> dict[str, dict[str, float]]:
    """Each system's row of the table: median tokens/s, token-latency percentiles, mean exit layer, over its
    first ``repeats`` runs (None: all), so that every system reads the same interleaved repeats and none
    the extra pairs some systems ran after them (:meth:`_DecodeBench.batch`)."""
    rows = {}
    for name, rs in runs.items():
        rs = rs[:repeats]
        lat = np.concatenate([r.token_latencies for r in rs]) if rs else np.zeros(0)
        layers = [e for r in rs for seq in (r.exit_layers or []) for e in seq]
        rows[name] = {
            "tokens_per_s": float(np.median([sequences * n / r.seconds for r in rs])),
            "token_latency_p50_ms": float(1e3 * np.percentile(lat, 50)) if lat.size else None,
            "token_latency_p95_ms": float(1e3 * np.percentile(lat, 95)) if lat.size else None,
            "mean_exit_layer": float(np.mean(layers)) if layers else None,
        }
    return rows


def paired_ratio(runs: dict[str, list[RunResult]], num: str, den: str) -> float | None:
    """Median over repeats of (tokens/s of num) / (tokens/s of den), pairing repeat r with repeat r."""
    if num not in runs or den not in runs:
        return None
    return float(np.median([d.seconds / u.seconds for u, d in zip(runs[num], runs[den])]))


def peak_rss_mib(system: str, run_dir: str, batch: int, cfg: DecodeBenchConfig) -> float:
    """Peak RSS of a fresh process that loads ``system`` and runs it once at ``batch``."""
    out = subprocess.run([sys.executable, "-m", "edge.pipeline.bench.decode", "--memory", system, run_dir, str(batch),
                          str(cfg.prompt_tokens), str(cfg.new_tokens), str(cfg.threads)],
                         capture_output=True, text=True, check=False, timeout=600)
    if out.returncode != 0:
        raise ConfigError(f"memory probe for {system} failed: {out.stderr.strip()[-400:]}")
    return float(out.stdout.strip().splitlines()[-1])



def _memory_probe(argv: list[str]) -> None:
    system, run_dir, batch, prompt_tokens, new_tokens, threads = argv
    cfg = DecodeBenchConfig(run_dir=run_dir, prompt_tokens=int(prompt_tokens), new_tokens=int(new_tokens),
                            threads=int(threads))
    torch.set_num_threads(cfg.threads)
    import onnxruntime  # noqa: F401  (import every library first: their import peak is not the system's)
    import transformers  # noqa: F401

    if system == "baseline":  # the interpreter with every library imported, nothing loaded
        print(vm_kib("VmRSS") / 1024)
        return
    run = open_run(run_dir, cfg.threads)
    ckpt, graphs, graphs_full, thresholds = run.path, run.graphs(), run.graphs(full=True), run.thresholds
    # llama.cpp's GGUF type follows the served model's precision: read it before the peak is reset
    precision = precision_of(load_served(ckpt)) if system == "llamacpp" else None
    before = vm_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the peak RSS (VmHWM) to the current RSS
    model = load_served(ckpt) if system.startswith("engine") else None
    systems = Systems(cfg, ckpt, graphs, graphs_full, thresholds, model, only=(system,), precision=precision)
    prompts = run.prompts(int(batch), cfg.prompt_tokens, cfg.seed)
    systems.run(system, prompts, cfg.new_tokens)
    print((vm_kib("VmHWM") - before) / 1024)  # MiB the system added at its peak




def decode_ratio(runs: dict[str, list[RunResult]], num: str, den: str, sequences: int, n: int) -> float | None:
    """Median over paired repeats of decode-only tokens/s of num over den."""
    if num not in runs or den not in runs:
        return None
    return float(np.median([decode_tokens_per_s(u, sequences, n) / decode_tokens_per_s(d, sequences, n)
                            for u, d in zip(runs[num], runs[den])]))


def source_rows(rs: list[RunResult]) -> dict[str, Any]:
    """(e)'s rounds by draft source over its repeats, pooled, and its plain steps; ``tokens_per_call``: tokens
    a verification call emitted (a lookup round is one call; an exit round's draft steps are calls too)."""
    stats = [d for r in rs for d in r.source_stats]
    out: dict[str, Any] = {"plain_steps": int(sum(d["plain_steps"] for d in stats))}
    for src in Source:
        out[src.value] = pool_stats([d[src.value] for d in stats if d[src.value]["rounds"]])
    return out


def decode_tokens_per_s(r: RunResult, sequences: int, n: int) -> float:
    """Decode alone: the n - 1 tokens after each sequence's first, over the gaps between its tokens."""
    return sequences * (n - 1) / sum(r.token_latencies)


def llamacpp_rows(runs: dict[str, list[RunResult]], bench: list, sequences: int, n: int, prompt_tokens: int) -> dict:
    """llama.cpp's rows at batch 1, decode and prefill apart: its Python API (the runs of system
    ``llamacpp``) and llama-bench (``bench``: one DecodeSpeed per repeat, or none), and a function giving our
    system's decode-only speed-up over the faster row, the median over repeats of the paired ratios."""
    from edge.pipeline.bench.llamacpp_bench import DecodeSpeed, faster_row

    api = runs["llamacpp"]
    rows = [DecodeSpeed("python-api", tuple(decode_tokens_per_s(r, sequences, n) for r in api),
                        tuple(sequences * prompt_tokens / (r.seconds - sum(r.token_latencies)) for r in api))]
    if bench:
        rows.append(DecodeSpeed("llama-bench", tuple(x.decode_tokens_per_s for x in bench),
                                tuple(x.prefill_tokens_per_s for x in bench)))
    best = faster_row(rows)

    def ratio(ours: list[RunResult]) -> float:
        return float(np.median([decode_tokens_per_s(r, sequences, n) / t for r, t in zip(ours, best.decode_samples)]))

    return {"rows": {r.source: r.to_dict() for r in rows}, "used": best.source, "ratio": ratio}


def engine_check_point_cost(systems: Systems, prompts: list[list[int]], n: int, layer_ms: float,
                            repeats: int) -> dict[str, float]:
    """What a check point costs a token that does not leave, in the engine at batch 1, host work included:
    the exits export with every row checked and none leaving (NeverExit: its score is always negative)
    against (c) on the same prompts, paired runs, median; per check point, in layers (``layer_ms``)."""
    n_checks = len(systems.backend.exit_layers) - 1
    never, full = [], []
    for rep in range(repeats + 1):  # the first pair warms up
        pair = (("never", lambda g, k: run_batch(systems.backend, NeverExit(), g, k, KVMode.DEFER)),
                ("full", lambda g, k: systems.run("engine_full", g, k)))
        for name, fn in (pair if rep % 2 == 0 else pair[::-1]):
            r = run_groups(fn, [[p] for p in prompts], n)
            if rep:
                (never if name == "never" else full).append(r.seconds / (len(prompts) * n))
    extra_ms = 1e3 * float(np.median(np.array(never) - np.array(full)))
    return {"extra_ms_per_token": extra_ms, "checks": n_checks, "layers": extra_ms / n_checks / layer_ms,
            "ratio_never_vs_full": float(np.median(np.array(never) / np.array(full)))}


def profile_step(systems: Systems, prompts: list[list[int]], n: int, system: str) -> dict[str, float]:
    """Where the time of (d)'s decode goes: ms per decode step by component, at this batch."""
    backend = ProfiledBackend(systems.backend)
    rule = ProfiledRule(systems.table_rule)
    res = systems.run(system, prompts, n, backend=backend, rule=rule, group=1)
    steps = len(prompts) * (n - 1)
    parts = {k: 1e3 * v / steps for k, v in {**backend.seconds, "exit_rule": rule.seconds}.items()}
    parts["total"] = 1e3 * res.seconds / steps
    parts["engine_other"] = parts["total"] - sum(v for k, v in parts.items() if k != "total")
    return {k: round(v, 3) for k, v in parts.items()}


class _DecodeBench:
    """One run of ``smartexit bench decode``, as the steps ``main`` takes in order."""

    def __init__(self, cfg: DecodeBenchConfig) -> None:
        """Open the run and load every system; check the settings against the model."""
        self.cfg = cfg
        self.sweep_warmup = cfg.warmup if cfg.spec_sweep_warmup is None else cfg.spec_sweep_warmup
        run = open_run(cfg.run_dir, cfg.threads)
        graphs = run.graphs()
        model = run.model
        if not 1 <= cfg.layerskip_exit < model.num_layers:
            raise ConfigError(f"bench.layerskip_exit must be in [1, {model.num_layers - 1}], got {cfg.layerskip_exit}")
        systems = Systems(cfg, run.path, graphs, run.graphs(full=True), run.thresholds, model)
        decision_exits = list(systems.backend.exit_layers[:-1])
        if cfg.draft_exit is not None and cfg.draft_exit not in decision_exits:
            raise ConfigError(f"bench.draft_exit must be a decision exit of this model {decision_exits} or null, "
                              f"got {cfg.draft_exit}")
        if not decision_exits:
            raise ConfigError("bench: the exits export has no decision exit, so (e) has no layer to draft from")
        spec = SpecConfig(draft_exit=cfg.draft_exit or decision_exits[0], stop=cfg.spec_stop)
        systems.spec = spec
        d_mode = KVMode(systems.table_rule.table.kv_mode if cfg.kv_mode == "table" else cfg.kv_mode)
        systems.gated_mode = d_mode
        results: dict[str, Any] = {"config": asdict(cfg), "batches": {}, "kv_mode": d_mode.value,
                                   "kv_mode_certified": d_mode.value == systems.table_rule.table.kv_mode,
                                   "ort_pool_threads": systems.backend.pool_threads,
                                   "llamacpp_skipped": systems.llamacpp_skipped,
                                   "speculative_config": {"draft_exit": spec.draft_exit, "stop": spec.stop.value,
                                                          "max_draft": spec.max_draft}}
        self.run, self.graphs, self.model, self.systems = run, graphs, model, systems
        self.decision_exits, self.spec, self.d_mode, self.results = decision_exits, spec, d_mode, results

    def call_costs(self) -> None:
        """What cutting the decoder into segments costs, and (a shortlist model) what a check costs, in layers."""
        cfg, run, model, graphs, systems, results = (self.cfg, self.run, self.model, self.graphs, self.systems,
                                                     self.results)
        kv_frac = kv_fraction(model)
        results["segment_call_overhead"] = {str(b): segment_call_overhead(model, cfg.overhead_spans, b,
                                                                          cfg.prompt_tokens + cfg.new_tokens).to_dict()
                                            for b in (1, max(cfg.batch_sizes))}
        print("segment calls vs one call: " + ", ".join(f"batch {b} {r['ratio']:.3f}x"
                                                         for b, r in results["segment_call_overhead"].items()), flush=True)
        if model.has_shortlist:  # what a candidate check costs, in layers (edge/pipeline/bench/decision.py)
            results["decision_cost"] = {str(b): decision_cost(model, graphs / FUSED_DIR, b, cfg.prompt_tokens + cfg.new_tokens // 2,
                                                              cfg.threads, repeats=cfg.decision_repeats).to_dict()
                                        for b in (1, max(cfg.batch_sizes))}
            results["decision_cost"]["engine_b1"] = engine_check_point_cost(
                systems, run.prompts(cfg.batch1_prompts, cfg.prompt_tokens, cfg.seed),
                cfg.new_tokens, results["decision_cost"]["1"]["layer_ms"], max(cfg.repeats, 3))
            print("decision cost (layers per check): " + ", ".join(
                f"batch {b} check {r['check_layers']:.3f}, boundary {r['boundary_layers']:.3f}"
                for b, r in results["decision_cost"].items() if b != "engine_b1")
                + f"; a check point in the engine at batch 1 {results['decision_cost']['engine_b1']['layers']:.3f}",
                flush=True)
        self.kv_frac = kv_frac

    def start(self) -> None:
        """The counters over every batch size and the progress bar."""
        cfg, systems, spec, decision_exits, d_mode = self.cfg, self.systems, self.spec, self.decision_exits, self.d_mode
        d_sys = exit_system(d_mode)
        exit_systems = [exit_system(m) for m in KVMode]
        wrong = {s: [0, 0] for s in exit_systems}  # system -> [mismatches, tokens]
        match_c = 0
        spec_bad = [0, 0]  # (e) against (c): [differing tokens, tokens compared]
        same_total = [0, 0]  # (e) against mode full on (e)'s own graphs
        sweep = cfg.spec_sweep and 1 in cfg.batch_sizes
        n_variants = len(distinct(sweep_variants(spec, decision_exits)))
        names_at = {b: [s for s in SYSTEMS if applicable(s, b) and s in systems.loaded] for b in cfg.batch_sizes}
        # the prompt-lookup peers load what hf and llamacpp load: their memory is those rows'; of the exit engines
        # only (d)'s K/V mode is probed, and neither LayerSkip (hf's weights) nor (e) (the exits' graphs and a
        # draft head): the goals read (d) against (a) and (c), and a probe costs ~7 s of the demo
        memory = [s for s in ("baseline", *SYSTEMS) if s == "baseline" or (
            s in systems.loaded and not s.endswith("_lookup") and s not in ("layerskip", "engine_speculative")
            and s != "engine_exit_gated" and (s not in exit_systems or s == d_sys))] if cfg.memory else []
        bar = tqdm(total=sum((cfg.warmup + cfg.repeats) * len(v) + len(exit_systems) + 2 * self._extra_pairs(v)
                             for v in names_at.values())
                   + 1 + len(memory) + (self.sweep_warmup + cfg.spec_sweep_repeats) * n_variants * sweep,
                   desc="bench decode", unit="run", disable=None)
        self.d_sys, self.exit_systems, self.wrong, self.match_c = d_sys, exit_systems, wrong, match_c
        self.spec_bad, self.same_total, self.sweep, self.names_at = spec_bad, same_total, sweep, names_at
        self.memory, self.bar = memory, bar

    def _extra_pairs(self, names: list[str]) -> int:
        """How many paired repeats of (e) and (c) a batch row adds to its own (``spec_extra_pairs``; 0 where
        either does not run)."""
        return self.cfg.spec_extra_pairs if {"engine_speculative", "engine_full"} <= set(names) else 0

    def batch(self, b: int) -> None:
        """Every system at batch ``b``, interleaved; its row of the results."""
        cfg, run, model, systems, results, bar = self.cfg, self.run, self.model, self.systems, self.results, self.bar
        d_sys, d_mode, kv_frac, wrong, names_at = self.d_sys, self.d_mode, self.kv_frac, self.wrong, self.names_at
        exit_systems, spec_bad, same_total = self.exit_systems, self.spec_bad, self.same_total
        n_prompts = cfg.batch1_prompts if b == 1 else b
        prompts = run.prompts(n_prompts, cfg.prompt_tokens, cfg.seed)
        names = names_at[b]
        runs: dict[str, list[RunResult]] = {s: [] for s in names}
        bench_rows = []  # llama-bench at batch 1, one measurement per repeat (interleaved with the others)
        with_bench = b == 1 and "llamacpp" in names and systems.llama_bench_skipped is None
        for rep in range(cfg.warmup + cfg.repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for s in order:
                bar.set_postfix_str(f"batch {b}, {'warm-up' if rep < cfg.warmup else 'repeat'} {rep + 1}, {s}")
                settle()  # the last system's threads stop spinning first (edge/pipeline/bench/quiesce.py)
                r = systems.run(s, prompts, cfg.new_tokens, group=b)
                bar.update()
                if rep >= cfg.warmup:
                    runs[s].append(r)
            if with_bench and rep >= cfg.warmup:
                settle()
                bench_rows.append(systems.llama_bench(cfg.new_tokens))
        for rep in range(self._extra_pairs(names)):  # (e) and (c) only, adjacent: (e)/(c) on more pairs
            for s in (("engine_speculative", "engine_full") if rep % 2 else ("engine_full", "engine_speculative")):
                bar.set_postfix_str(f"batch {b}, (e) against (c), pair {cfg.repeats + rep + 1}, {s}")
                settle()
                runs[s].append(systems.run(s, prompts, cfg.new_tokens, group=b))
                bar.update()
        row_fe = {}
        for s in exit_systems:
            bar.set_postfix_str(f"batch {b}, checking {s} against the full model")
            bad, total = false_exits(Served(systems.backend), prompts, runs[s][0],
                                     KVMode(s.removeprefix("engine_exit_")))
            bar.update()
            wrong[s][0] += bad
            wrong[s][1] += total
            row_fe[s] = bad / max(1, total)
        full, ex = runs["engine_full"][0].tokens, runs[d_sys][0].tokens
        self.match_c += sum(a == b_ for x, y in zip(full, ex) for a, b_ in zip(x, y))
        bad_e = [token_mismatches(e.tokens, c.tokens) for e, c in zip(runs["engine_speculative"], runs["engine_full"])]
        spec_bad[0] += sum(m for m, _ in bad_e)
        spec_bad[1] += sum(t for _, t in bad_e)
        bar.set_postfix_str(f"batch {b}, (e) against mode full on the same graphs")
        # at (e)'s batch size (b prompts at a time), so each reference step has (e)'s plain steps' shapes
        ref = [t for i in range(0, len(prompts), b) for t in run_batch(
            systems.backend, systems.table_rule, prompts[i:i + b], cfg.new_tokens, KVMode.PROPAGATE,
            mode=Mode.FULL).tokens]
        exact_tokens = runs["engine_speculative"][0].tokens
        same_bad = token_mismatches(exact_tokens, ref)
        same_div = divergences(systems.backend, prompts, exact_tokens, ref)
        same_total[0] += same_bad[0]
        same_total[1] += same_bad[1]
        peer = None
        if "llamacpp" in runs:
            peer = llamacpp_rows(runs, bench_rows, n_prompts, cfg.new_tokens, cfg.prompt_tokens)
            results["llamacpp"] = {"gguf_type": systems.peer_type, "repack": systems.peer.repack,
                                   "rows": peer["rows"], "used": peer["used"],
                                   "llama_bench_skipped": systems.llama_bench_skipped}
        if "llamacpp" in runs and systems.peer_type == "f32":
            # the f32 peer's speed counts only if it decodes what the same f32 weights decode; a quantized peer
            # (q8_0) rounds otherwise than our INT8 model, so its agreement with (c) is reported, not required
            ref = "hf" if "hf" in runs else "engine_full"  # (== (c) when the run is not compressed)
            match = _token_match(runs["llamacpp"][0].tokens, runs[ref][0].tokens)
            results["llamacpp_token_match"] = match
            if match < 1.0:
                results["llamacpp_skipped"] = (f"its greedy tokens match transformers' on the same weights on only "
                                               f"{match:.1%} of tokens: speed not reported")
                del runs["llamacpp"]
                peer = None
        elif "llamacpp" in runs:
            results["llamacpp_token_match_vs_full_engine"] = _token_match(runs["llamacpp"][0].tokens,
                                                                          runs["engine_full"][0].tokens)
        # the systems' table over the interleaved repeats only, the same for every system: the extra pairs of (e)
        # and (c) ran in another stretch of the machine's time (stop 57's demo J: (c) 2,567 tokens/s over all 11
        # runs beside (d)'s 1,752 over its 3, where (d)/(c) paired read 0.97)
        systems_row = summarise(runs, n_prompts, cfg.new_tokens, repeats=cfg.repeats)
        exits_d = [e for seq in runs[d_sys][0].exit_layers for e in seq[1:]]  # decoded tokens (the first is prefill)
        ceiling = model.num_layers / layers_computed(exits_d, model.num_layers, d_mode, kv_frac)
        speedup = paired_ratio(runs, d_sys, "engine_full")
        results["batches"][str(b)] = {
            "systems": systems_row,
            "speedup_exit_vs_full": speedup,
            # layers / mean layers computed per token of (d), recomputation counted (module docstring)
            "compute_ceiling": ceiling,
            "efficiency_vs_ceiling": speedup / ceiling,
            "speedup_exit_vs_hf": paired_ratio(runs, d_sys, "hf"),
            "speedup_exit_vs_layerskip": paired_ratio(runs, d_sys, "layerskip"),
            # decode only, same precision, against the faster llama.cpp row (llama-bench where it is built)
            "speedup_full_vs_llamacpp": None if peer is None else peer["ratio"](runs["engine_full"]),
            "speedup_exit_vs_llamacpp": None if peer is None else peer["ratio"](runs[d_sys]),
            "speedup_vs_full_by_mode": {m.value: paired_ratio(runs, exit_system(m), "engine_full") for m in KVMode},
            # (d) with the served engine's step gate (edge/runtime/gate.py), and the share of its steps it let check
            "speedup_exit_gated_vs_full": paired_ratio(runs, "engine_exit_gated", "engine_full"),
            "gate_share_checked": gate_share(systems, b),
            # what (d)/(c) would be if time were proportional to the layers a token runs and
            # deciding cost nothing: the bound the exit depth alone sets
            "exit_depth_ceiling": model.num_layers / systems_row[d_sys]["mean_exit_layer"],
            "full_engine_equals_hf": runs["engine_full"][0].tokens == runs["hf"][0].tokens,
            # a compressed run's engine decodes its quantized model: how often it still picks HF's f32 token
            "full_engine_token_match_hf": _token_match(runs["engine_full"][0].tokens, runs["hf"][0].tokens),
            "false_exit_rate": row_fe[d_sys],
            "false_exit_rate_by_mode": {m.value: row_fe[exit_system(m)] for m in KVMode},
            "speedup_speculative_vs_full": paired_ratio(runs, "engine_speculative", "engine_full"),
            "speculative_pairs": min(len(runs["engine_speculative"]), len(runs["engine_full"])),
            # the same without the prompts' prefill, which both run alike (a 64-token prompt's prefill is ~17% of
            # (c)'s time for 32 new tokens at batch 1): what drafting does to the decode itself; not a goal's key
            "speedup_speculative_vs_full_decode_only": decode_ratio(runs, "engine_speculative", "engine_full",
                                                                    n_prompts, cfg.new_tokens),
            "speedup_speculative_vs_layerskip": paired_ratio(runs, "engine_speculative", "layerskip"),
            # (e)'s rounds over its measured repeats: acceptance rate, mean accepted length, tokens per round
            "speculative": pool_stats([d for r in runs["engine_speculative"] for d in r.spec_stats]),
            "speculative_mismatches": sum(m for m, _ in bad_e),
            "speculative_tokens_compared": sum(t for _, t in bad_e),
            # the same against mode full on the same backend (the graph (e) verifies with), and where each
            # differing sequence first differs, with the full model's top-2 logit gap there
            "speculative_mismatches_same_graph": same_bad[0],
            "speculative_tokens_compared_same_graph": same_bad[1],
            "speculative_divergences_same_graph": same_div,
            "speculative_by_source": source_rows(runs["engine_speculative"]),
            "speedup_speculative_vs_hf_lookup": paired_ratio(runs, "engine_speculative", "hf_lookup"),
            # decode only, same precision
            "speedup_speculative_vs_llamacpp_lookup": decode_ratio(runs, "engine_speculative", "llamacpp_lookup",
                                                                   n_prompts, cfg.new_tokens),
            "speedup_speculative_vs_llamacpp": None if peer is None else peer["ratio"](runs["engine_speculative"]),
        }
        tqdm.write(f"batch {b}: " + ", ".join(f"{s} {v['tokens_per_s']:.1f} tok/s"
                                              for s, v in results["batches"][str(b)]["systems"].items()))

    def exact_and_totals(self) -> None:
        """False exits and token match over every batch; (e)'s stop-rule sweep and ceiling at batch 1; (e)'s
        mismatches over every exact run."""
        cfg, run, systems, results, bar, spec = self.cfg, self.run, self.systems, self.results, self.bar, self.spec
        d_sys, wrong, match_c, decision_exits = self.d_sys, self.wrong, self.match_c, self.decision_exits
        spec_bad, same_total, sweep = self.spec_bad, self.same_total, self.sweep
        rates = {s: bad / max(1, total) for s, (bad, total) in wrong.items()}
        results["false_exit_rate"] = rates[d_sys]
        results["false_exit_rate_by_mode"] = {m.value: rates[exit_system(m)] for m in KVMode}
        results["false_exit_tokens"] = wrong[d_sys][1]
        results["token_match_vs_full_engine"] = match_c / sum(
            (cfg.batch1_prompts if b == 1 else b) * cfg.new_tokens for b in cfg.batch_sizes)
        results["speculative_stop_rules"] = results["speculative_by_draft_exit"] = None
        if sweep:
            prompts = run.prompts(cfg.batch1_prompts, cfg.prompt_tokens, cfg.seed)

            def tick(what: str) -> None:
                bar.set_postfix_str(f"(e) sweep at batch 1, {what}")
                bar.update()

            stops, by_exit, bad = speculative_sweep(systems, prompts, cfg.new_tokens, self.sweep_warmup,
                                                    cfg.spec_sweep_repeats, spec, decision_exits, tick)
            results["speculative_stop_rules"], results["speculative_by_draft_exit"] = stops, by_exit
            spec_bad = [spec_bad[0] + bad[0], spec_bad[1] + bad[1]]  # every exact run counts against losslessness
            results["speculative_calibrated_vs_best_other_b1"] = calibrated_vs_best_other(stops)
        results["speculative_ceiling"] = None
        # the ceiling records the draft exit's host-side decision inputs along full-depth decoding; a shortlist
        # model decides in its graphs and has none (its replay is not ported: the closing note of issue 27)
        skip_ceiling = cfg.spec_ceiling and systems.backend.spec.candidates
        results["speculative_ceiling_skipped"] = (
            "the model decides over a candidate shortlist in its graphs: the ceiling's host-side recording does not "
            "apply" if skip_ceiling else None)
        if cfg.spec_ceiling and decision_exits and not skip_ceiling:
            bar.set_postfix_str("(e) the self-speculation ceiling at batch 1")
            draft = spec.draft_exit if spec.draft_exit is not None else decision_exits[0]
            prompts = run.prompts(cfg.batch1_prompts, cfg.prompt_tokens, cfg.seed)
            trace = agreement_trace(systems.backend, systems.table_rule, prompts, cfg.new_tokens, draft)
            costs = measure_costs(systems.backend, systems.full_backend, draft, spec.max_draft + 1,
                                  past=cfg.prompt_tokens + cfg.new_tokens // 2)
            results["speculative_ceiling"] = {"draft_exit": draft, **spec_ceiling(trace, costs, spec)}
        results["speculative_mismatches"], results["speculative_tokens_compared"] = spec_bad
        results["speculative_mismatches_same_graph"], results["speculative_tokens_compared_same_graph"] = same_total

    def exact_at_verify_batches(self) -> None:
        """(e) against (c) at ``spec_verify_batches`` (default: the batch sizes the export verifies several
        sequences at in one call, ``Backend.verify_batches``, that the batch rows do not run): warm-up +
        repeats, interleaved and paired; their mismatches count with every other exact run's."""
        cfg, run, systems, results, bar = self.cfg, self.run, self.systems, self.results, self.bar
        sizes = ([b for b in systems.backend.verify_batches if b not in cfg.batch_sizes]
                 if cfg.spec_verify_batches is None else cfg.spec_verify_batches)
        rows = {}
        for b in sizes:
            prompts = run.prompts(b, cfg.prompt_tokens, cfg.seed)
            runs: dict[str, list[RunResult]] = {"engine_speculative": [], "engine_full": []}
            for rep in range(cfg.warmup + cfg.repeats):
                for s in (("engine_speculative", "engine_full") if rep % 2 else ("engine_full", "engine_speculative")):
                    bar.set_postfix_str(f"(e) at batch {b}, {'warm-up' if rep < cfg.warmup else 'repeat'} {rep + 1}, {s}")
                    r = systems.run(s, prompts, cfg.new_tokens)
                    if rep >= cfg.warmup:
                        runs[s].append(r)
            bad = [token_mismatches(e.tokens, c.tokens) for e, c in zip(runs["engine_speculative"], runs["engine_full"])]
            self.spec_bad[0] += sum(m for m, _ in bad)  # every exact run counts against losslessness
            self.spec_bad[1] += sum(t for _, t in bad)
            rows[str(b)] = {"speedup_speculative_vs_full": paired_ratio(runs, "engine_speculative", "engine_full"),
                            "verify_graph": b in systems.backend.verify_batches,
                            "speculative_by_source": source_rows(runs["engine_speculative"]),
                            "speculative_mismatches": sum(m for m, _ in bad),
                            "speculative_tokens_compared": sum(t for _, t in bad)}
            tqdm.write(f"(e) at batch {b} ({'verify graph' if rows[str(b)]['verify_graph'] else 'per-row calls'}): "
                       f"{rows[str(b)]['speedup_speculative_vs_full']:.2f}x (c), "
                       f"{rows[str(b)]['speculative_mismatches']} of {rows[str(b)]['speculative_tokens_compared']} "
                       "tokens differ")
        results["speculative_by_verify_batch"] = rows

    def verification_and_profile(self) -> None:
        """rho(k) at batch 1 and at the batch sizes the export verifies in one call, and a profiled decode
        step of (d)."""
        cfg, run, systems, results, bar, d_sys = self.cfg, self.run, self.systems, self.results, self.bar, self.d_sys
        bar.set_postfix_str("rho(k): verification calls of k rows at batch 1")
        past = cfg.prompt_tokens + cfg.new_tokens // 2
        results["verify_cost_ratio_b1"] = verify_cost_ratios(systems.backend, past)
        results["verify_cost_ratio_by_batch"] = {str(b): verify_cost_ratios(systems.backend, past, batch=b)
                                                 for b in systems.backend.verify_batches}
        bar.set_postfix_str("profiling a decode step of (d)")
        results["profile_b1"] = profile_step(systems, run.prompts(cfg.batch1_prompts,
                                                                      cfg.prompt_tokens, cfg.seed), cfg.new_tokens, d_sys)
        bar.update()

    def peak_memory(self) -> None:
        """Each system's peak resident memory, each in a fresh process."""
        cfg, results, bar, memory = self.cfg, self.results, self.bar, self.memory
        if cfg.memory:
            b = max(cfg.batch_sizes)
            results["peak_rss_mib"] = {}
            for s in memory:
                bar.set_postfix_str(f"peak memory of {s}, a fresh process")
                results["peak_rss_mib"][s] = peak_rss_mib(s, cfg.run_dir, b if applicable(s, b) else 1, cfg)
                bar.update()

    def publish(self, t0: float) -> None:
        """bench/decode.{json,md,png}, the manifest's record, the summary lines."""
        cfg, run, systems, results, bar, graphs = self.cfg, self.run, self.systems, self.results, self.bar, self.graphs
        bar.close()
        cal = Manifest(cfg.run_dir).stage("calibrate")["metrics"]  # quality is measured there, on more tokens
        results["calibration"] = {k: cal.get(k) for k in ("layers_skipped_frac", "accuracy_loss_rel",
                                                           "free_run_false_exit_rate_test", "kv_mode")}
        # the false-exit goal is the tolerance the table was certified for
        results["calibration"]["epsilon"] = systems.table_rule.table.epsilon
        summary = headline(results)
        summary["goals"] = goals(summary, results["calibration"]["epsilon"], cfg.batch_sizes)
        out = Path(cfg.run_dir) / "bench"
        # bench/ holds the other benches' outputs (compress, energy, serve, projection): a re-run of this one
        # replaces its own files only
        publish_files(out, {"decode.json": lambda p: atomic_write_json(p, {**results, "summary": summary}),
                            "decode.md": lambda p: p.write_text(render_markdown(results, summary)),
                            "decode.png": lambda p: plot(results, p)})
        run.manifest.record(STAGE, inputs={"checkpoint": run.path, "graphs": graphs, "graphs_full": run.graphs(full=True),
                                           "thresholds": run.thresholds},
                                     config=results["config"], outputs={"json": out / "decode.json",
                                                                        "png": out / "decode.png"},
                                     metrics={**summary, "batches": results["batches"],
                                              "profile_b1": results["profile_b1"],
                                              "speculative_config": results["speculative_config"],
                                              "speculative_stop_rules": results["speculative_stop_rules"],
                                              "speculative_by_draft_exit": results["speculative_by_draft_exit"],
                                              "peak_rss_mib": results.get("peak_rss_mib")},
                                     seconds=time.time() - t0)
        for line in summary_lines(results, summary, out / "decode.md", time.time() - t0):
            print(line)


def main(cfg: DecodeBenchConfig) -> int:
    t0 = time.time()
    bench = _DecodeBench(cfg)
    bench.call_costs()
    bench.start()
    for b in cfg.batch_sizes:
        bench.batch(b)
    bench.exact_at_verify_batches()
    bench.exact_and_totals()
    bench.verification_and_profile()
    bench.peak_memory()
    bench.publish(t0)
    return 0

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--memory":
    _memory_probe(sys.argv[2:])
