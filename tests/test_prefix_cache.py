"""Prefix caching in the vLLM engines the pipeline starts: the flag on the offline engine's arguments and on a server's
command line, and the hit rate read from hand-written metrics (no engine starts here)."""

from __future__ import annotations

import http.server
import logging
import threading
from types import SimpleNamespace

import pytest
from conftest import free_port

from pipeline.config import config_from_dict
from pipeline.engines import servers
from pipeline.engines.generation.vllm_offline import cache_counts, engine_kwargs
from pipeline.engines.prefix_cache import CacheCounts, from_metrics, from_metrics_text

# A vLLM server's /metrics as Prometheus's text format writes it: counters get `_total` (and a `_created` beside,
# which is a timestamp, not a count); two engines, a label value with a space and a brace in it.
METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="my model}"} 400.0
vllm:prefix_cache_queries_total{engine="1",model_name="my model}"} 100.0
vllm:prefix_cache_queries_created{engine="0",model_name="my model}"} 1.7e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="my model}"} 300.0
vllm:prefix_cache_hits_total{engine="1",model_name="my model}"} 20.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="my model}"} 9999.0
vllm:prompt_tokens_total{engine="0",model_name="my model}"} 512.0
"""


def test_the_hit_rate_of_a_servers_metrics_text():
    counts = from_metrics_text(METRICS)
    # hits 300 + 20 = 320 of queries 400 + 100 = 500: 64.0%; the external cache's and `_created` are not counted
    assert counts == CacheCounts(hits=320, queries=500)
    assert counts.hit_rate == pytest.approx(0.64)
    assert counts.describe() == "prefix cache hit rate 64.0% (320 of 500 prompt tokens)"
    unlabelled = "vllm:prefix_cache_queries_total 10\nvllm:prefix_cache_hits_total 4 1700000000\n"
    assert from_metrics_text(unlabelled) == CacheCounts(hits=4, queries=10)  # a timestamp after the value
    assert from_metrics_text("# nothing\nprocess_cpu_seconds_total 3.0\n") is None  # not a vLLM server


def test_a_span_is_the_difference_of_two_readings():
    before, after = CacheCounts(hits=100, queries=200), CacheCounts(hits=400, queries=600)
    # 400 - 100 = 300 hits of 600 - 200 = 400 looked up: 75.0%
    assert (after - before).describe() == "prefix cache hit rate 75.0% (300 of 400 prompt tokens)"
    assert CacheCounts().hit_rate is None and "no prompt tokens" in CacheCounts().describe()


def test_the_hit_rate_of_an_offline_engines_snapshot():
    # LLM.get_metrics(): counters by their name without `_total`, one per engine; gauges and others beside
    snapshot = [SimpleNamespace(name="vllm:prefix_cache_queries", labels={"engine": "0"}, value=96),
                SimpleNamespace(name="vllm:prefix_cache_hits", labels={"engine": "0"}, value=64),
                SimpleNamespace(name="vllm:kv_cache_usage_perc", labels={"engine": "0"}, value=0.5)]
    assert from_metrics(snapshot) == CacheCounts(hits=64, queries=96)
    assert cache_counts(SimpleNamespace(get_metrics=lambda: snapshot)).hit_rate == pytest.approx(64 / 96)

    def stats_off():
        raise AssertionError("Stat logging disabled")  # vLLM's answer where the engine keeps no stats

    assert cache_counts(SimpleNamespace(get_metrics=stats_off)) is None
    assert from_metrics([]) is None


def test_the_offline_engine_is_started_with_the_flag_and_its_stats():
    on, off = engine_kwargs("org/model"), engine_kwargs("org/model", enable_prefix_caching=False)
    assert on["enable_prefix_caching"] is True and off["enable_prefix_caching"] is False
    assert on["disable_log_stats"] is False  # the counters exist only with stats on
    # the block size is vLLM's own unless set: prefix caching reuses whole blocks
    assert "block_size" not in on and engine_kwargs("org/model", block_size=32)["block_size"] == 32


def test_a_servers_command_line_says_prefix_caching_either_way():
    def command(caching: bool | None) -> list[str]:
        serve = {} if caching is None else {"enable_prefix_caching": caching}
        cfg = config_from_dict({"executor": {"kind": "openai", "serve": serve},
                                "generator": {"backend": "openai", "serve": serve}})
        return [arg for section in ("executor", "generator")
                for arg in servers.spec_for(cfg, section).command("/m", 1)]

    assert command(None).count("--enable-prefix-caching") == 2 and "--no-enable-prefix-caching" not in command(None)
    assert command(False).count("--no-enable-prefix-caching") == 2 and "--enable-prefix-caching" not in command(False)
    spec = servers.ServerSpec("/m", "m")
    assert servers.spec_key(spec) != servers.spec_key(servers.ServerSpec("/m", "m", prefix_caching=False))


def test_a_stage_logs_its_servers_hit_rate_over_the_stage(caplog):
    """The counters at the block's end less those at its start (a server shared by several stages counts on)."""
    readings = iter([CacheCounts(hits=100, queries=200), CacheCounts(hits=400, queries=600)])

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            counts = next(readings)
            body = (f"vllm:prefix_cache_queries_total{{engine=\"0\"}} {counts.queries}\n"
                    f"vllm:prefix_cache_hits_total{{engine=\"0\"}} {counts.hits}\n").encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    port = free_port()
    httpd = http.server.HTTPServer(("127.0.0.1", port), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = servers.Server(servers.ServerSpec("/m", "m"), f"http://127.0.0.1:{port}")
        with caplog.at_level(logging.INFO, logger="pipeline.engines.servers"), \
                servers.cache_report(server, "round-0-score: executor server m"):
            pass
    finally:
        httpd.shutdown()
        httpd.server_close()
    # 300 of 400 prompt tokens over the stage
    assert "round-0-score: executor server m: prefix cache hit rate 75.0% (300 of 400 prompt tokens)" in caplog.text


def test_a_server_without_metrics_logs_nothing(caplog):
    port = free_port()  # nothing listens: the reading is None, and so is the report
    server = servers.Server(servers.ServerSpec("/m", "m"), f"http://127.0.0.1:{port}")
    with caplog.at_level(logging.INFO, logger="pipeline.engines.servers"), servers.cache_report(server, "x"):
        pass
    assert "prefix cache" not in caplog.text


def test_the_bench_compares_two_sides_samples_up_to_where_they_part():
    from pipeline.perf.prefix_cache import agreement

    first = (((1, 2, 3), (-0.5, -1.0, -2.0)), ((4, 5), (-0.1, -0.2)), ((6,), (-3.0,)))
    # the first sample the same tokens (log-probs 1e-6 and 3e-6 apart); the second parts at its second token, whose
    # log-probabilities (0.7 apart) are past the parting and so not counted; the third the same, no log-probs kept
    other = (((1, 2, 3), (-0.500001, -1.0, -2.000003)), ((4, 9), (-0.1, -0.9)), ((6,), ()))
    same, total, gap = agreement(first, other)
    assert (same, total) == (2, 3)
    assert gap == pytest.approx(3e-6, abs=1e-12)
