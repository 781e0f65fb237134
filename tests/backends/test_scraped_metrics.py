"""The parts of a vLLM /metrics page the gateway keeps, read without parsing the rest."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from backends.scraped_metrics import parse_upstream_metrics, samples_of


def histogram(name: str, count: float, total: float) -> str:
    buckets = "".join(
        f'{name}_bucket{{engine="0",le="{le}",model_name="m"}} {count}\n'
        for le in ("0.001", "0.01", "0.1", "1.0", "+Inf")
    )
    return (
        f"# HELP {name} A histogram.\n# TYPE {name} histogram\n{buckets}"
        f'{name}_count{{engine="0",model_name="m"}} {count}\n'
        f'{name}_sum{{engine="0",model_name="m"}} {total}\n'
    )


PAGE = (
    "# HELP python_gc_objects_collected_total Objects collected during gc\n"
    "# TYPE python_gc_objects_collected_total counter\n"
    'python_gc_objects_collected_total{generation="0"} 1234.0\n'
    "# HELP vllm:prefix_cache_queries_total Prefix cache queries.\n"
    "# TYPE vllm:prefix_cache_queries_total counter\n"
    'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 640.0\n'
    'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9\n'
    "# HELP vllm:num_requests_running Running.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
    + histogram("vllm:time_to_first_token_seconds", 7.0, 0.5)
    + histogram("vllm:e2e_request_latency_seconds", 7.0, 3.5)
    + histogram("vllm:nixl_xfer_time_seconds", 3.0, 0.01)
    + "# HELP vllm:nixl_num_failed_transfers_total Failed.\n"
    "# TYPE vllm:nixl_num_failed_transfers_total counter\n"
    'vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0\n'
)


def test_the_filtered_parse_keeps_exactly_what_a_full_parse_keeps() -> None:
    full = samples_of(text_string_to_metric_families(PAGE))
    assert parse_upstream_metrics(PAGE) == full
    assert {s.name for s in full} == {
        "vllm:prefix_cache_queries_total",
        "vllm:num_requests_running",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_to_first_token_seconds_sum",
        "vllm:nixl_xfer_time_seconds_count",
        "vllm:nixl_xfer_time_seconds_sum",
        "vllm:nixl_num_failed_transfers_total",
    }
    ttft = [s for s in full if s.name == "vllm:time_to_first_token_seconds_sum"]
    assert ttft[0].value == 0.5 and ttft[0].labels == ()
