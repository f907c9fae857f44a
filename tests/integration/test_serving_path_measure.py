"""The serving path's measurement on the real stack (scheduler/loadtest/serving_runs.py ``measure``, what
`smartexit profile` calibrates the simulator from): one stack for every budget, switched between runs, and a
warm-up whose requests and steps are not kept; a run placed by what the earlier ones measured."""
from __future__ import annotations


def test_one_stack_serves_each_budget_and_the_warm_up_is_not_measured(served_run, repository_copy, tmp_path):
    """Two runs at budgets 64 and 16 after a warm-up: every request of both runs succeeds, the first run's
    50-token prompts are prefilled in one chunk and the second's 40-token ones in chunks of at most 16 (the
    budget switched on the running stack), and the kept steps hold none of the warm-up's 33-token prompts."""
    from scheduler.loadtest.loadgen import ScheduledRequest
    from scheduler.loadtest.serving_runs import measure

    run = repository_copy(served_run, tmp_path / "run")

    def schedule(n: int, length: int, tag: str) -> list:
        return [ScheduledRequest(0.05 * i, [5 + (i + j) % 40 for j in range(length)], 6, f"{tag}{i}")
                for i in range(n)]

    seen = []

    def more(results: list, steps: list) -> list:  # what profile's serving_edge_run does with the runs so far
        seen.append(([len(r) for r in results], len(steps)))
        return [(32, schedule(4, 36, "c"))]

    results, steps = measure(run, [(64, schedule(5, 50, "a")), (16, schedule(5, 40, "b"))], max_seqs=4,
                             sla=(5000.0, 500.0), step_log=tmp_path / "steps.jsonl", warm=schedule(4, 33, "w"),
                             serve={"max_tokens_limit": 32}, more=more)  # the micro model's context: 256 positions
    # http_run sends the first two of each schedule one by one, unmeasured, then the schedule
    assert [len(r) for r in results] == [5, 5, 4] and all(x.ok and x.tokens >= 1 for r in results for x in r)
    assert seen[0][0] == [5, 5] and 0 < seen[0][1] < len(steps)  # called once, with the first two runs' steps
    firsts = [tokens for st in steps for start, tokens in st["p"] if start == 0]
    # beside the runs' prompts, the host's audit re-decodes a prompt and some of its output (a prefill of 41-46
    # or 51-56 tokens at the budget of the moment)
    assert firsts.count(50) >= 5  # at budget 64 in one chunk: two unmeasured warm-ups and the run's three
    assert 40 not in firsts and sum(t <= 16 for t in firsts) >= 5  # at budget 16 in chunks of at most 16
    assert 33 not in firsts  # the warm-up's 33-token prompts are not kept
    assert 36 not in firsts and sum(16 < t <= 32 for t in firsts) >= 4  # the placed run at its budget: 32
    # every kept step names its decoding sequences' requests (the step log's ``i``, in ``k``'s order)
    assert all(st["i"] is not None and len(st["i"]) == len(st["k"]) for st in steps)
    # the runs as the profile keeps them (serving_runs.json) give the fit the same requests back
    from scheduler.loadtest.serving_fit import latency_stats
    from scheduler.loadtest.serving_runs import load_runs, save_runs

    save_runs(tmp_path / "runs.json", results, [64, 16, 32])
    back, budgets = load_runs(tmp_path / "runs.json")
    assert budgets == [64, 16, 32] and [latency_stats(r) for r in back] == [latency_stats(r) for r in results]
