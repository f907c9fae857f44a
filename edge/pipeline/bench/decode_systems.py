"""The systems ``smartexit bench decode`` times (:mod:`edge.pipeline.bench.decode`'s docstring names them), each
loaded once on the same weights: transformers (a, and LayerSkip b, and prompt lookup), the SmartExit engine at full
depth (c), with exits (d) and speculative (e), llama.cpp (f); ``Systems.run`` generates with one of them."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from calibration.table import TableRule, load_table
from edge.compress.apply import precision_of
from edge.core.artifacts import Manifest
from edge.core.errors import ConfigError, SmartExitError
from edge.model.exits import MultiExitModel
from edge.pipeline.bench.decode_config import DecodeBenchConfig
from edge.pipeline.bench.summary import SYSTEMS
from edge.runtime.backend import make_backend
from edge.runtime.batch import RunResult, run_batch
from edge.runtime.engine_config import KVMode
from edge.runtime.request import Mode
from edge.runtime.rules import NeverExit
from edge.runtime.speculative import SpecConfig


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
        from edge.pipeline.bench import (llamacpp, llamacpp_bench, llamacpp_gguf, llamacpp_lookup, llamacpp_peer,
                                          llamacpp_tokenizer)

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
        try:  # repacked weights where they run (llamacpp_repack.repack_runs); a peer that cannot decode is skipped
            self.peer = llamacpp_peer.LlamaCppPeer(self.gguf, self.cfg.threads)
        except SmartExitError as exc:
            self.llamacpp_skipped = str(exc)
            return
        self.peer_lookup = llamacpp_lookup.LlamaCppLookupPeer(self.gguf, self.cfg.threads, repack=self.peer.repack)
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


def exit_system(mode: KVMode | str) -> str:
    return f"engine_exit_{KVMode(mode).value}"


def applicable(name: str, batch: int) -> bool:
    # transformers' assisted generation and prompt lookup need batch 1; llama.cpp is measured as a batch-1 decoder
    return not (name in ("layerskip", "llamacpp", "hf_lookup", "llamacpp_lookup") and batch > 1)
