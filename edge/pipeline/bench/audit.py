"""``smartexit bench audit``: the stage. The work is :mod:`scheduler.loadtest.bench_audit`'s; this module reads the run, calls it and
records what it made."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from edge.core.artifacts import Manifest, atomic_write_json, atomic_write_text
from scheduler.loadtest.bench_audit import AuditJob, BenchAuditConfig, STAGE, audit_runs, broken, word_salad


def main(cfg: BenchAuditConfig) -> int:
    from edge.core.data import Split, TokenCorpus, load_split
    from edge.model.tokenizer import load_tokenizer
    from calibration.pvalues import PValue, upper_confidence_bound

    t0 = time.perf_counter()
    from scheduler.serving.stack import bundle as run_bundle

    bundle = run_bundle(cfg.run_dir)  # ConfigError naming `smartexit repo` when there is none
    tok = load_tokenizer(bundle / "tokenizer.json")
    # i.i.d. windows of the test split (document uniform, offset uniform), as calibration draws its units
    code = [[int(t) for t in w] for w in TokenCorpus(tok, load_split(Split.TEST)).draw(cfg.prompts, cfg.prompt_tokens,
                                                                                       cfg.seed).ids]
    jobs = {"heldout_code": AuditJob(code, "code"),  # the longest first: the processes end together
            "heldout_code_as_served": AuditJob(code, "served", as_served=True),
            "broken_rule": AuditJob(code[:cfg.broken_prompts], "broken", rule_edit=broken),
            "word_salad": AuditJob(word_salad(code[:cfg.salad_prompts], cfg.seed), "salad")}
    done = audit_runs(bundle, jobs, cfg, cfg.workers or None)
    runs = {name: done[name] for name in ("heldout_code", "word_salad", "heldout_code_as_served", "broken_rule")}
    epsilon = runs["heldout_code"]["epsilon"]  # the threshold table's, as the host audits it
    delta = runs["heldout_code"]["delta"]
    for r in runs.values():  # the per-request test's bound at delta, from the units in completion order
        losses = r.pop("unit_losses")
        r["requests"]["bound"] = upper_confidence_bound(losses, delta, PValue.BETTING, seed=None) if losses else 1.0
    report = {"stage": STAGE, "config": asdict(cfg), "epsilon": epsilon, "runs": runs,
              "caught": bool(runs["word_salad"]["fallback"]), "false_alarm": bool(runs["heldout_code"]["fallback"]),
              "caught_broken_rule": bool(runs["broken_rule"]["fallback"])}
    out = Path(cfg.run_dir) / "bench"
    md = ["# Online false-exit audit: in domain vs another domain", "",
          f"Every token of {cfg.prompts} held-out requests ({cfg.salad_prompts} of word salad; {cfg.prompt_tokens} "
          f"prompt tokens, up to {cfg.max_tokens} new, greedy, mode bounded) audited: "
          + ("an early exit by the engine's own verdict (deferral computes its skipped layers with the next token, "
             "and the last layer's head on that row), one it could not judge (the request ended first) re-decoded "
             "at full depth" if runs["heldout_code"].get("engine_verdicts") else "re-decoded at full depth")
          + f"; epsilon {epsilon} (the table's), one-sided Clopper-Pearson bounds at delta "
          f"{runs['heldout_code']['delta']}; the fallback fires "
          + ("when the requests' mean rate exceeds epsilon by the anytime-valid betting test (requests as units, "
             "trigger `requests`)" if runs["heldout_code"]["trigger"] == "requests"
             else f"on the per-token {runs['heldout_code']['trigger']} bound") + ".", "",
          "| traffic | audited tokens | false exits | rate | lower | upper | fallback (after tokens) | per exit (audited / false) "
          "| exits judged by the engine / re-decoded | requests audited whole: n, mean rate, p-value, bound "
          "| p-value of mean > eps | seconds |",
          "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | --- | ---: | ---: |"]
    for name, r in runs.items():
        per = ", ".join(f"{k}: {v['audited']} / {v['false']}" for k, v in r["exits"].items())
        vc, u = r.get("verdict_counts") or {}, r["requests"]
        md.append(f"| {name} | {r['audited']} | {r['false']} | {r['rate']:.4f} | {r['lower']:.4f} | {r['upper']:.4f} | "
                  f"{r['fallback']} ({r['fired_after']}) | {per} | {vc.get('judged', 0)} / {vc.get('unjudged', 0)} | "
                  f"{u['requests']}, {u['mean']:.4f}, {u['p_value']:.3g}, {u['bound']:.4f}"
                  f"{' (certified)' if u['certified'] else ''} | {u['exceeds_p_value']:.3g} | {r['seconds']:.1f} |")
    md += ["", "Requests audited whole are the units of the certificate's own test (betting p-value of H0: mean "
               "per-request false-exit rate > epsilon, in completion order, anytime-valid); its bound is the (1 - delta) "
               "upper confidence bound on that mean. `heldout_code` and `word_salad` run exits as the rule decides "
               "them (step gate and bounded drafts off); `heldout_code_as_served` runs the engine as the bundle "
               "serves it: the composite the certificate is argued to cover, tested here on held-out traffic; "
               "`broken_rule` serves the first held-out requests under the table with its thresholds dropped and "
               "routing off (every row checked, every check exiting; the certificate's epsilon kept): a rule that "
               "breaks its certificate, which the fallback must catch (later requests then run at full depth)."]
    paths = {"json": out / "audit.json", "md": out / "audit.md"}
    atomic_write_text(paths["md"], "\n".join(md) + "\n")
    atomic_write_json(paths["json"], report)
    metrics = {"epsilon": epsilon, "caught": report["caught"], "false_alarm": report["false_alarm"],
               "caught_broken_rule": report["caught_broken_rule"],
               **{f"{n}_rate": r["rate"] for n, r in runs.items()},
               **{f"{n}_fired_after": r["fired_after"] for n, r in runs.items()},
               **{f"{n}_engine_judged": (r.get("verdict_counts") or {}).get("judged", 0) for n, r in runs.items()},
               **{f"{n}_request_p_value": r["requests"]["p_value"] for n, r in runs.items()},
               **{f"{n}_request_bound": r["requests"]["bound"] for n, r in runs.items()}}
    Manifest(cfg.run_dir).record(STAGE, inputs={"bundle": bundle}, config=asdict(cfg), outputs=paths,
                                 metrics=metrics, seconds=time.perf_counter() - t0)
    print("\n".join(md[4:]))
    return 0
