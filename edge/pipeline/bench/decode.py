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
order; the transformers peers run only their first ``peer_repeats`` where it is set); ratios are
computed repeat by repeat (pairing a peer's repeats with the first ones of the other system) and their
median reported. Tokens/s counts
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

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from tqdm import tqdm

from edge.pipeline.bench.summary import SYSTEMS
from edge.runtime.engine_config import KVMode
from edge.runtime.speculative import SpecConfig
from edge.core.errors import ConfigError
from edge.pipeline.bench.decision import decision_cost
from edge.pipeline.bench.decode_config import DecodeBenchConfig
from edge.pipeline.bench.decode_measure import (_token_match, engine_check_point_cost, false_exits,
                                                gate_share, kv_fraction, layers_computed, llamacpp_rows,
                                                paired_ratio, profile_step, summarise)
from edge.pipeline.bench.decode_memory import _memory_probe, peak_rss_mib
from edge.pipeline.bench.decode_publish import publish_results
from edge.pipeline.bench.decode_speculative import against_same_graph, at_batch1, at_verify_batches, batch_row_keys
from edge.pipeline.bench.decode_systems import Systems, applicable, exit_system
from edge.pipeline.bench.segments import segment_call_overhead
from edge.runtime.graphs import FUSED_DIR
from edge.runtime.batch import RunResult
from edge.pipeline.run import open_run
from edge.pipeline.bench.quiesce import settle
from edge.pipeline.bench.speculation import distinct, verify_cost_ratios, sweep_variants, token_mismatches
from calibration.freerun import Served


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
        bar = tqdm(total=sum(sum(cfg.warmup + cfg.repeats_of(s) for s in v) + len(exit_systems) + 2 * self._extra_pairs(v)
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
                if rep >= cfg.warmup + cfg.repeats_of(s):  # a peer measured fewer times (``peer_repeats``)
                    continue
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
        same_bad, same_div = against_same_graph(systems, prompts, b, cfg.new_tokens,
                                                runs["engine_speculative"][0].tokens)
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
            **batch_row_keys(runs, bad_e, same_bad, same_div, n_prompts, cfg.new_tokens, peer),
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
        studies, bad = at_batch1(cfg, run, systems, bar, spec, decision_exits, sweep, self.sweep_warmup)
        results.update(studies)
        spec_bad = [spec_bad[0] + bad[0], spec_bad[1] + bad[1]]  # every exact run counts against losslessness
        results["speculative_mismatches"], results["speculative_tokens_compared"] = spec_bad
        results["speculative_mismatches_same_graph"], results["speculative_tokens_compared_same_graph"] = same_total

    def exact_at_verify_batches(self) -> None:
        """(e) against (c) at ``spec_verify_batches`` (default: the batch sizes the export verifies several
        sequences at in one call, ``Backend.verify_batches``, that the batch rows do not run): warm-up +
        repeats, interleaved and paired; their mismatches count with every other exact run's."""
        rows, bad = at_verify_batches(self.cfg, self.run, self.systems, self.bar)
        self.spec_bad[0] += bad[0]  # every exact run counts against losslessness
        self.spec_bad[1] += bad[1]
        self.results["speculative_by_verify_batch"] = rows

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
        """Each system's peak resident memory, each in a fresh process, as many at once as there are cores: a
        probe reads its own process's peak (VmHWM), which a process beside it leaves alone, and four one after
        the other took 15 s of the demo's bench on the 2-core Intel VM (stop 68)."""
        cfg, results, bar, memory = self.cfg, self.results, self.bar, self.memory
        if cfg.memory:
            b = max(cfg.batch_sizes)
            results["peak_rss_mib"] = {}
            bar.set_postfix_str(f"peak memory of {', '.join(memory)}, fresh processes")
            with ThreadPoolExecutor(max(1, min(len(memory), os.cpu_count() or 1))) as probes:
                peaks = {s: probes.submit(peak_rss_mib, s, cfg.run_dir, b if applicable(s, b) else 1, cfg)
                         for s in memory}
                for s in memory:
                    results["peak_rss_mib"][s] = peaks[s].result()
                    bar.update()

    def publish(self, t0: float) -> None:
        """bench/decode.{json,md,png}, the manifest's record, the summary lines."""
        self.bar.close()
        publish_results(self.cfg, self.run, self.graphs, self.results, self.systems.table_rule.table.epsilon, t0)


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