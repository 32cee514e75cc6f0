"""Benchmark inputs and outputs that need no server: datasets, SSE events, the telemetry CSV, config."""
import csv
import json
from pathlib import Path

import pytest

from treeserve.bench.client import event_data
from treeserve.bench.datasets import LOWEST_TOKEN_ID, DatasetSpec, sample_requests
from treeserve.bench.run import BenchConfig
from treeserve.bench.telemetry import parse_prometheus, write_union_csv

MATH500 = Path(__file__).resolve().parents[1] / "data" / "math500.jsonl"  # vendored (data/README.md)


def test_random_prompts_have_unique_prefixes_and_exact_lengths():
    spec = DatasetSpec(input_len=40, output_len=7, vocab_size=300, seed=3)
    first = sample_requests(spec, 200, first_index=0)
    later = sample_requests(spec, 200, first_index=200)  # the next level of the same run
    prompts = [r.prompt for r in first + later]
    assert all(len(p) == 40 and r.prompt_len == 40 and r.output_len == 7 for p, r in zip(prompts, first + later))
    assert len({tuple(p[:3]) for p in prompts}) == 400  # no two prompts share even a 3-token prefix
    assert all(LOWEST_TOKEN_ID <= t < 300 for p in prompts for t in p)
    assert sample_requests(spec, 5)[3].prompt == first[3].prompt  # seeded


def test_shared_prefix_buckets():
    spec = DatasetSpec(input_len=64, output_len=4, shared_prefix_len=32, shared_prefix_groups=2, seed=0)
    prompts = [r.prompt for r in sample_requests(spec, 6)]
    assert prompts[0][:32] == prompts[2][:32] == prompts[4][:32]
    assert prompts[1][:32] == prompts[3][:32] and prompts[0][:32] != prompts[1][:32]
    assert len({tuple(p[:35]) for p in prompts}) == 6  # still unique right after the shared part


def test_random_lengths_vary_with_range_ratio():
    spec = DatasetSpec(input_len=100, output_len=50, range_ratio=0.5, seed=1)
    reqs = sample_requests(spec, 300)
    assert min(len(r.prompt) for r in reqs) >= 50 and max(len(r.prompt) for r in reqs) <= 150
    assert len({r.output_len for r in reqs}) > 20


def test_sharegpt_jsonl_and_math500_files(tmp_path):
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Tell me a story"}, {"from": "gpt", "value": "x" * 400}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
    ]))
    rows = sample_requests(DatasetSpec(name="sharegpt", path=str(sharegpt)), 3)
    assert [r.prompt for r in rows] == ["Tell me a story"] * 3
    assert rows[0].output_len == 100  # 400 characters at 4 per token, without a tokenizer
    custom = tmp_path / "p.jsonl"
    custom.write_text('{"prompt": "a", "output_len": 5}\n\n{"prompt": "b"}\n')
    rows = sample_requests(DatasetSpec(name="jsonl", path=str(custom), output_len=None, seed=0), 2)
    assert sorted((r.prompt, r.output_len) for r in rows) == [("a", 5), ("b", 256)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match="line 1 .* no 'prompt'"):
        sample_requests(DatasetSpec(name="jsonl", path=str(bad)), 1)
    with pytest.raises(ValueError, match="dataset_path"):
        DatasetSpec(name="math500")


def test_tokenizer_sets_vocabulary_and_lengths(llama_dir, tmp_path):
    from treeserve.bench.datasets import load_tokenizer

    tokenizer = load_tokenizer(str(llama_dir))
    config = BenchConfig(base_url="http://x", out="o", tokenizer=str(llama_dir), input_len=[16])
    spec = config.dataset_spec(config.levels[0])
    assert spec.vocab_size == len(tokenizer)
    sharegpt = tmp_path / "sg.json"
    reply = "the water is the people who live near it"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Hi there"},
                                                       {"from": "gpt", "value": reply}]}]))
    [row] = sample_requests(DatasetSpec(name="sharegpt", path=str(sharegpt), tokenizer=str(llama_dir)), 1)
    assert row.prompt_len == len(tokenizer.encode("Hi there", add_special_tokens=False))
    assert row.output_len == len(tokenizer.encode(reply, add_special_tokens=False))


@pytest.mark.skipif(not MATH500.is_file(), reason="MATH-500 not present")
def test_math500_problems():
    rows = sample_requests(DatasetSpec(name="math500", path=str(MATH500), output_len=64), 500)
    problems = {json.loads(line)["problem"] for line in MATH500.read_text().splitlines()}
    assert {r.prompt for r in rows} == problems and all(r.output_len == 64 for r in rows)


def test_sse_event_data():
    assert event_data(b'data: {"a": 1}') == b'{"a": 1}'
    assert event_data(b": keep-alive comment") is None
    assert event_data(b"event: x\ndata: [DONE]") == b"[DONE]"
    assert event_data(b"data: one\ndata: two") == b"one\ntwo"


def test_telemetry_csv_union_header_with_gaps(tmp_path):
    first = parse_prometheus('# TYPE m:running gauge\nm:running{model_name="x"} 2\n')
    second = parse_prometheus('# TYPE m:running gauge\nm:running{model_name="x"} 3\n'
                              '# TYPE m:done counter\nm:done_total{model_name="x",reason="stop"} 4\n')
    assert second == {'m:running{model_name="x"}': 3.0, 'm:done_total{model_name="x",reason="stop"}': 4.0}
    rows = [{"t": 0.0, "time_unix": 100.0, **first}, {"t": 0.2, "time_unix": 100.2, **second},
            {"t": 0.4, "time_unix": 100.4, "host_cpu_percent": 5.0}]
    header = write_union_csv(rows, tmp_path / "telemetry.csv")
    with open(tmp_path / "telemetry.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == header == ["t", "time_unix", 'm:running{model_name="x"}',
                                  'm:done_total{model_name="x",reason="stop"}', "host_cpu_percent"]
    assert table[1] == ["0.0", "100.0", "2.0", "", ""]
    assert table[2] == ["0.2", "100.2", "3.0", "4.0", ""]
    assert table[3] == ["0.4", "100.4", "", "", "5.0"]


def test_bench_config_from_dict_and_errors():
    config = BenchConfig.from_dict({"base-url": "http://x", "out": "o", "concurrency": "1,4", "output_len": 8})
    assert config.concurrency == [1, 4] and config.output_len == [8]
    assert [level.concurrency for level in config.levels] == [1, 4]
    rate = BenchConfig.from_dict({"base_url": "http://x", "out": "o", "request_rate": [2, "inf"]})
    assert rate.concurrency == [None] and len(rate.levels) == 2
    with pytest.raises(ValueError, match="unknown option"):
        BenchConfig.from_dict({"base_url": "http://x", "out": "o", "concurency": 4})
    with pytest.raises(ValueError, match="concurrency: 'x' is not a number"):
        BenchConfig.from_dict({"base_url": "http://x", "out": "o", "concurrency": "1,x"})
    with pytest.raises(ValueError, match="concurrency: must be >= 1"):
        BenchConfig.from_dict({"base_url": "http://x", "out": "o", "concurrency": 0})


def test_stream_parsing_across_split_reads_and_crlf_framing():
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from treeserve.bench.client import ClientPool, Clock, Endpoint, RequestRecord, send_request
    from treeserve.bench.datasets import SampleRequest

    pieces = [b'data: {"choices": [{"text": "a", "finish_reason": null}]}\r', b'\n\r\ndata: {"choices": [{"te',
              b'xt": "", "finish_reason": null}]}\r\n\r\n: comment\r\n\r\ndata: {"choices": [{"text": "b", '
              b'"finish_reason": "length"}]}\r\n\r\ndata: {"choices": [], "usage": {"prompt_tokens": 3, '
              b'"completion_tokens": 4}}\r\n\r\ndata: [DONE]\r\n\r\n']

    async def stream(request):  # a real server writing the events in the pieces above, a pause between
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(0.02)
        return response

    async def run(record, endpoint):
        app = web.Application()
        app.router.add_post("/v1/completions", stream)
        async with TestServer(app) as server, ClientPool() as pool:
            endpoint.base_url = str(server.make_url(""))
            await send_request(pool, endpoint, SampleRequest([11, 12, 13], 3, 4), record, Clock())

    record = RequestRecord(index=0, level=0, warmup=False, start=0.0)
    endpoint = Endpoint("http://server", "m")
    asyncio.run(run(record, endpoint))
    assert record.success and record.error == ""
    assert len(record.chunk_times) == 2  # "a" and "b"; the empty-text chunk and the comment carry no text
    assert record.chunk_times[1] - record.chunk_times[0] >= 0.02  # each timed when its piece arrived
    assert (record.prompt_tokens, record.output_tokens, record.finish_reason) == (3, 4, "length")
    assert not record.output_tokens_counted
    payload = endpoint.payload(SampleRequest([11, 12, 13], 3, 4))
    assert payload["ignore_eos"] and payload["max_tokens"] == 4 and payload["stream_options"] == {"include_usage": True}


def _read_events(*events: bytes):
    """A record read by the client from a stream of these SSE events (a real aiohttp server)."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from treeserve.bench.client import ClientPool, Clock, Endpoint, RequestRecord, send_request
    from treeserve.bench.datasets import SampleRequest

    async def stream(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
        return response

    async def run(record):
        app = web.Application()
        app.router.add_post("/v1/completions", stream)
        async with TestServer(app) as server, ClientPool() as pool:
            endpoint = Endpoint(str(server.make_url("")), "m")
            await send_request(pool, endpoint, SampleRequest([11, 12], 2, 4), record, Clock())

    record = RequestRecord(index=0, level=0, warmup=False, start=0.0)
    asyncio.run(run(record))
    return record


TEXT = b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'


def test_a_stream_cut_short_or_ending_in_an_error_event_is_a_failure():
    """Before, both counted as completed requests (in request throughput, with their few tokens)."""
    cut = _read_events(TEXT, TEXT)  # the server stopped: no finish_reason, no [DONE]
    assert not cut.success and "ended early" in cut.error
    vllm_error = _read_events(TEXT, b'data: {"object": "error", "message": "engine dead", "type": "Internal'
                              b'ServerError", "code": 500}\n\n', b"data: [DONE]\n\n")  # older vLLM's error event
    assert not vllm_error.success and "engine dead" in vllm_error.error
    openai_error = _read_events(TEXT, b'data: {"error": {"message": "boom"}}\n\n', b"data: [DONE]\n\n")
    assert not openai_error.success and "boom" in openai_error.error


def test_a_stream_with_done_or_a_finish_reason_is_a_success():
    finished = _read_events(TEXT, b'data: {"choices": [{"text": "b", "finish_reason": "length"}]}\n\n')
    assert finished.success and finished.output_tokens == 2 and finished.output_tokens_counted
    done_unterminated = _read_events(TEXT, b"data: [DONE]\n")  # no blank line after the last event
    assert done_unterminated.success and done_unterminated.output_tokens == 1


def test_vllm_bench_serve_options_work_or_say_what_to_use(capsys):
    """A `vllm bench serve` command line: before, argparse refused --num-prompts, --dataset-name,
    --random-input-len, --max-concurrency and --endpoint /v1/completions with no hint."""
    from treeserve.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "serve", "--base-url", "http://x", "--out", "o", "--model", "m", "--dataset-name", "random",
         "--random-input-len", "32", "--random-output-len", "8", "--random-range-ratio", "0.1", "--num-prompts", "7",
         "--max-concurrency", "4", "--request-rate", "2", "--burstiness", "0.5", "--seed", "3",
         "--endpoint", "/v1/completions", "--ignore-eos", "--goodput", "ttft:500", "tpot:50"])
    assert (args.dataset, args.input_len, args.output_len, args.range_ratio) == ("random", "32", "8", 0.1)
    assert (args.num_requests, args.concurrency, args.request_rate, args.endpoint) == (7, "4", "2", "completions")
    chat = build_parser().parse_args(["bench", "serve", "--base-url", "http://x", "--out", "o", "--endpoint",
                                      "/v1/chat/completions", "--dataset-name", "custom", "--dataset-path", "p"])
    assert (chat.endpoint, chat.dataset) == ("chat", "jsonl")
    for option in (["--save-result"], ["--result-dir", "runs"], ["--backend", "vllm"], ["--metric-percentiles", "99"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "serve", "--base-url", "http://x", "--out", "o", *option])
        assert f"{option[0]} is a `vllm bench serve` option" in capsys.readouterr().err
