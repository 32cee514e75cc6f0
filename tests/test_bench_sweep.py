"""A short sweep against a real `treeserve serve` on a tiny model: every artefact, consistent with
the server's own counters."""
import csv
import json
import shutil
import socket
import sys

import pytest
import yaml

from treeserve.cli import main

NUM_REQUESTS, WARMUP, OUTPUT_LEN, INPUT_LEN = 6, 2, 5, 24
PLOTS = ("throughput_over_time.png", "kv_cache_and_queue.png", "latency_vs_load.png", "saturation.png")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def sweep_dir(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-sweep")
    port = free_port()
    command = [sys.executable, "-m", "treeserve.cli", "serve", str(llama_dir), "--port", str(port),
               "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
               "--kv-cache-memory-bytes", str(16 << 20), "--max-model-len", "256"]
    sweep = {"out": str(root / "out"),
             "bench": {"concurrency": [1, 4], "num_requests": NUM_REQUESTS, "warmup": WARMUP,
                       "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "goodput": ["ttft:60000"],
                       "telemetry_interval": 0.1},
             "servers": [{"name": "tiny", "command": command, "base_url": f"http://127.0.0.1:{port}",
                          "env": {"OMP_NUM_THREADS": "1"}, "startup_timeout": 120}]}
    (root / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    assert main(["bench", "sweep", str(root / "sweep.yaml")]) == 0
    return root / "out" / "tiny"


def load(run_dir):
    records = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    with open(run_dir / "telemetry.csv", newline="") as f:
        table = list(csv.reader(f))
    return records, json.loads((run_dir / "summary.json").read_text()), table


def test_every_artefact_exists(sweep_dir):
    for name in ("config.json", "requests.jsonl", "telemetry.csv", "summary.json", "report.md", "server.log") + PLOTS:
        assert (sweep_dir / name).stat().st_size > 0, name
    for name in PLOTS:
        assert (sweep_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in (sweep_dir / "report.md").read_text()
    config = json.loads((sweep_dir / "config.json").read_text())
    assert config["model"] == "tiny" and config["concurrency"] == [1, 4]
    assert json.loads((sweep_dir.parent / "sweep.json").read_text())["servers"][0]["status"] == "ok"


def test_request_counts_and_lengths(sweep_dir):
    records, summary, _ = load(sweep_dir)
    assert len(records) == WARMUP + 2 * NUM_REQUESTS
    assert sum(r["warmup"] for r in records) == WARMUP
    assert all(r["success"] and r["output_tokens"] == OUTPUT_LEN and r["prompt_tokens"] == INPUT_LEN for r in records)
    assert [(lv["concurrency"], lv["completed"], lv["failed"]) for lv in summary["levels"]] == [(1, 6, 0), (4, 6, 0)]
    for level in summary["levels"]:
        mine = [r for r in records if r["level"] == level["level"]]
        assert level["total_output_tokens"] == sum(r["output_tokens"] for r in mine)
        assert level["ttft_ms"]["count"] == NUM_REQUESTS and level["goodput"] == level["request_throughput"]
        assert level["output_len_bins"]["<=30"]["requests"] == NUM_REQUESTS
        # the server's counters over the level agree with what the client received
        assert level["server"]["generation_tokens"] == NUM_REQUESTS * OUTPUT_LEN
        assert level["server"]["prompt_tokens"] == NUM_REQUESTS * INPUT_LEN
        assert level["server"]["requests_finished"] == NUM_REQUESTS
        assert level["server"]["prefix_cache_hits"] == 0  # unique prefixes: nothing to find in the cache
        assert level["queue_time_ms"] is not None


def column(table, name):
    index = table[0].index(name)
    return [row[index] for row in table[1:]]


def test_telemetry_csv_matches_server_counters_and_request_clock(sweep_dir):
    records, _, table = load(sweep_dir)
    header = table[0]
    assert header[:2] == ["t", "time_unix"] and len(set(header)) == len(header)
    assert all(len(row) == len(header) for row in table[1:])
    for name in ('treeserve:generation_tokens_total{model_name="tiny"}',
                 'treeserve:kv_cache_usage_perc{model_name="tiny"}',
                 'treeserve:num_requests_waiting{model_name="tiny"}',
                 'treeserve:time_to_first_token_seconds_bucket{le="0.001",model_name="tiny"}',
                 "host_cpu_percent", "host_memory_used_bytes", "server_rss_bytes"):
        assert name in header, name
    # the server started fresh: its counters at the last scrape are the sums over every request sent
    last = dict(zip(header, table[-1]))
    generated, prompts = (f'treeserve:{name}_tokens_total{{model_name="tiny"}}' for name in ("generation", "prompt"))
    assert float(last[generated]) == sum(r["output_tokens"] for r in records)
    assert float(last[prompts]) == sum(r["prompt_tokens"] for r in records)
    finished = column(table, 'treeserve:request_success_total{finished_reason="length",model_name="tiny"}')
    # served at 0 from the start, as vLLM's (a series appearing mid-run gets empty cells before:
    # test_bench_metrics.py::test_a_series_that_appears_mid_run_has_empty_cells_before)
    assert float(finished[0]) == 0 and float(finished[-1]) == len(records)
    times = [float(t) for t in column(table, "t")]
    assert times == sorted(times)
    assert times[0] <= min(r["start"] for r in records) and times[-1] >= max(r["end"] for r in records)


def test_report_compares_runs(sweep_dir, tmp_path):
    other = tmp_path / "again"
    shutil.copytree(sweep_dir, other)
    assert main(["bench", "report", str(sweep_dir), str(other), "--out", str(tmp_path / "cmp")]) == 0
    text = (tmp_path / "cmp" / "report.md").read_text()
    assert "| concurrency | tiny | again |" in text and (tmp_path / "cmp" / "comparison.png").is_file()


def test_bench_serve_with_an_api_key(server, tmp_path):
    from conftest import wait_idle

    from treeserve.bench.run import BenchConfig, run_benchmark

    wait_idle(server.engine)
    config = BenchConfig(base_url=server.url, api_key=server.key, out=str(tmp_path), concurrency=[2], num_requests=4,
                         input_len=[16], output_len=[4], plots=False)
    summary = run_benchmark(config)
    level = summary["levels"][0]
    assert summary["model"] == "tiny"  # the first served model, from /v1/models
    assert level["completed"] == 4 and summary["telemetry"]["failed_scrapes"] == 0
    assert level["server"]["generation_tokens"] == 16
    assert "sk-test-key" not in (tmp_path / "config.json").read_text()
