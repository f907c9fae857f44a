"""Benchmarks: decode throughput against the peers (more workloads arrive with serving)."""
