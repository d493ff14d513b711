import math

from gateway.bench import _bodies, _vllm_flags, format_table
from gateway.cli import build_parser
from gateway.loadgen import LevelResult, percentile


def test_percentile():
    assert percentile([3, 1, 2], 0.5) == 2
    assert percentile([0, 10], 0.99) == 9.9
    assert math.isnan(percentile([], 0.5))


def test_vllm_flags_mirror_engine_args():
    assert _vllm_flags({"enforce_eager": True, "max_model_len": 512, "x": False}) == [
        "--enforce-eager", "--max-model-len", "512"]


def test_bodies_are_deterministic_streaming_chats():
    a, b = _bodies(4, 16, seed=1), _bodies(4, 16, seed=1)
    assert a == b and all(x["stream"] and x["max_tokens"] == 16 for x in a)


def test_table_has_ratios():
    r = LevelResult(concurrency=1, requests=10, errors=0, wall_s=2.0, output_tokens=100, ttft_p50_ms=10,
                    ttft_p99_ms=20, itl_p50_ms=1.0, latency_p50_ms=50)
    d = LevelResult(concurrency=1, requests=10, errors=0, wall_s=1.0, output_tokens=100, ttft_p50_ms=5,
                    ttft_p99_ms=10, itl_p50_ms=1.0, latency_p50_ms=25)
    table = format_table({"tandem": {1: r}, "direct": {1: d}}, [1])
    assert "| 1 | out tok/s | 50 | 100 | 0.50x |" in table
    assert "| 1 | TTFT p50 ms | 10 | 5 | 2.00x |" in table


def test_help_explains_every_command():
    parser = build_parser()
    text = parser.format_help()
    for cmd in ("serve", "build-tiny-models", "bench"):
        assert cmd in text
