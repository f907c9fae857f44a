"""The aiperf cross-check: its command line and the mapping of its export onto our metric names."""
from __future__ import annotations

from pathlib import Path

from scheduler.loadtest.crosscheck import CrossCheckConfig, aiperf_command, aiperf_numbers, our_numbers


def test_aiperf_command_is_the_closed_loop_we_run():
    cfg = CrossCheckConfig(aiperf="/x/aiperf", concurrency=4, requests=32, prompt_tokens=64, max_tokens=32)
    argv = aiperf_command(cfg, "http://127.0.0.1:8011", "m", Path("/t"), Path("/o"))
    assert argv[:2] == ["/x/aiperf", "profile"]
    pairs = dict(zip(argv[2::1], argv[3::1]))
    for flag, value in (("--concurrency", "4"), ("--request-count", "32"), ("--synthetic-input-tokens-mean", "64"),
                        ("--output-tokens-mean", "32"), ("--endpoint-type", "completions"), ("--tokenizer", "/t"),
                        ("--url", "http://127.0.0.1:8011"), ("-m", "m"), ("--extra-inputs", "temperature:0")):
        assert pairs[flag] == value, flag
    assert "--streaming" in argv


def test_numbers_line_up():
    export = {"time_to_first_token": {"avg": 22.0, "p50": 20.0, "p99": 40.0}, "inter_token_latency": {"p50": 10.0},
              "request_latency": {"avg": 335.0, "p50": 330.0}, "output_token_throughput": {"avg": 300.0},
              "request_throughput": {"avg": 9.5}, "output_sequence_length": {"avg": 31.5}}
    theirs = aiperf_numbers(export)
    ours = our_numbers({"ttft_mean_ms": 23.0, "e2e_mean_ms": 336.0, "ttft_p50_ms": 21.0, "ttft_p99_ms": 41.0, "tpot_p50_ms": 10.5, "e2e_p50_ms": 331.0,
                        "tokens_per_s": 299.0, "completed": 32, "duration_s": 3.2, "tokens": 1008})
    assert set(theirs) == set(ours)
    assert theirs["itl_p50_ms"] == 10.0 and ours["requests_per_s"] == 10.0 and ours["output_tokens_mean"] == 31.5
    assert aiperf_numbers({})["ttft_p50_ms"] is None


def test_server_means_from_two_scrapes():
    from scheduler.loadtest.crosscheck import server_counts, server_means

    def scrape(n, ttft_sum, e2e_sum, tokens):
        return server_counts(
            "# TYPE smartexit_ttft_seconds histogram\n"
            f'smartexit_ttft_seconds_bucket{{le="+Inf"}} {n}\nsmartexit_ttft_seconds_count {n}\n'
            f"smartexit_ttft_seconds_sum {ttft_sum}\n"
            "# TYPE smartexit_e2e_latency_seconds histogram\n"
            f'smartexit_e2e_latency_seconds_bucket{{le="+Inf"}} {n}\nsmartexit_e2e_latency_seconds_count {n}\n'
            f"smartexit_e2e_latency_seconds_sum {e2e_sum}\n"
            "# TYPE smartexit_generated_tokens counter\n"
            f"smartexit_generated_tokens_total {tokens}\n")

    m = server_means(scrape(2, 0.1, 1.0, 64), scrape(6, 0.5, 3.0, 192))
    assert m == {"ttft_mean_ms": 100.0, "e2e_mean_ms": 500.0, "requests": 4.0, "tokens": 128.0}
