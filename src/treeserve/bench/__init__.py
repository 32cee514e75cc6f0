"""Benchmarks against any OpenAI-compatible server: load, telemetry, metrics, reports, sweeps.

`treeserve bench serve|report|sweep|calibrate|throughput`; definitions in docs/BENCHMARKS.md.
"""
