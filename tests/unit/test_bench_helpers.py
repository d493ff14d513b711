import math

from tandem_tools.bench import _bodies, _vllm_flags, format_table
from tandem_tools.cli import build_parser
from tandem_tools.loadgen import LevelResult, percentile


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


# -- the diffusion benchmark's helpers ----------------------------------------------------------
def test_proc_readers_see_this_process_and_its_children():
    import os
    import subprocess
    import sys

    from tandem_tools.bench_diffusion import proc_cpu_s, proc_mem, proc_tree, reset_peak

    # a child that stays alive until killed below (its sleep is its lifetime, not a synchronisation)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in proc_tree(os.getpid())
        assert os.getpid() in proc_tree(os.getpid())
    finally:
        child.kill()
        child.wait()
    t0 = proc_cpu_s(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert proc_cpu_s(os.getpid()) > t0
    assert proc_cpu_s(2**22 + 12345) == 0.0  # gone: zero, not an error
    mem = proc_mem()
    assert mem["VmHWM"] >= mem["VmRSS"] > 0
    if reset_peak():  # Linux >= 4.0; the peak drops to about the current RSS
        after = proc_mem()
        assert after["VmHWM"] <= max(mem["VmHWM"], after["VmRSS"])


def test_memory_per_row_and_request_counts():
    from tandem_tools.bench_diffusion import MB, memory_per_row, num_requests

    m = memory_per_row(100 * MB, 500 * MB, 300 * MB, 4)
    assert (m["peak_growth_per_row_mb"], m["mean_growth_per_row_mb"], m["rss_before_mb"]) == (100, 50, 100)
    assert memory_per_row(100 * MB, 50 * MB, 0, 0)["peak_growth_per_row_mb"] == 0  # never negative
    assert [num_requests(0, c) for c in (1, 4, 8)] == [4, 8, 16]  # the tiny model's default
    assert [num_requests(2, c) for c in (1, 4)] == [2, 4]  # at least one round of c


def test_diffusion_bodies_carry_steps_and_seeds():
    from tandem_tools.bench_diffusion import bodies

    a = bodies("m", 3, 256, seed=4, steps=8)
    assert a == bodies("m", 3, 256, seed=4, steps=8)
    assert all(b["diffusion"] == {"max_denoising_steps": 8} and b["max_tokens"] == 256 for b in a)
    assert len({b["seed"] for b in a}) == 3
    assert "diffusion" not in bodies("m", 1, 32, seed=1)[0]


def test_tandem_config_sets_the_sampler_and_one_thread():
    import argparse

    from tandem_tools.bench_diffusion import tandem_config

    args = argparse.Namespace(port=9, memory_budget_gib=0)
    exact = tandem_config(args, "m", "/p", "exact", "row", 4)["models"][0]["engine_args"]
    assert exact == {"family": "diffusiongemma", "max_batch": 4, "boundaries": "row", "num_threads": 1}
    args.memory_budget_gib = 3.5
    fast = tandem_config(args, "m", "/p", "fast", "block", 4)["models"][0]["engine_args"]
    assert fast["sampler"] == "fast" and fast["memory_budget_gib"] == 3.5


def test_levels_and_model_names():
    import argparse

    from tandem_tools.bench_diffusion import _model, levels_for

    def ns(**kw):
        return argparse.Namespace(**{"concurrency": "1,8,32", "model": "tiny-diffusiongemma",
                                     "samplers": "exact,fast", **kw})

    assert levels_for(ns()) == [1, 4, 8, 16]
    assert levels_for(ns(model="shape-diffusiongemma"), 6) == [1, 4, 6]
    assert levels_for(ns(model="shape-diffusiongemma")) == [1, 4]
    assert levels_for(ns(concurrency="2,3")) == [2, 3]
    name, path, samplers = _model(ns(model="tiny-diffusiongemma-fast"))
    assert (name, samplers) == ("tiny-diffusiongemma", ["fast"]) and path.endswith("tiny-diffusiongemma")
    assert _model(ns(model="/some/dir/my-model", samplers="exact"))[::2] == ("my-model", ["exact"])


def test_fifo_latencies():
    from tandem_tools.bench_diffusion import fifo_latencies

    assert fifo_latencies([1.0, 1.0, 1.0], 1) == [1.0, 1.0, 1.0]
    assert fifo_latencies([1.0, 1.0], 2) == [1.0, 2.0]  # the second client waits for the first


def test_diffusion_table_has_ratios_to_hf_sequential_and_skips():
    from tandem_tools.bench_diffusion import format_table

    results = {"hf sequential": {1: {"tokens_per_s": 5.0, "cpu_ms_per_token": 200.0}},
               "hf static batch": {1: {"skipped": "needs ~9.0 GiB > --max-rss-gib 7"}},
               "tandem fast block": {1: {"tokens_per_s": 15.0, "cpu_ms_per_token": 50.0, "errors": 0,
                                         "outside_forward_share": 0.25}}}
    table = format_table(results, [1])
    assert "| 1 | out tok/s | 5.00 | - | 15.00 |" in table
    assert "| 1 | tok/s / HF sequential | 1.00x | - | 3.00x |" in table
    assert "| 1 | CPU per token / HF sequential | 1.00x | - | 0.25x |" in table
    assert "| 1 | outside forwards | - | - | 25.0% |" in table
    assert "hf static batch: needs ~9.0 GiB" in table


def test_engine_sampler_summarises_reservations_per_row():
    from tandem_tools.bench_diffusion import MB, EngineSampler

    s = EngineSampler("http://127.0.0.1:9", "m")
    s.samples = [{"running": 2, "memory_reserved_bytes": 100 * MB, "waiting_for_memory": 3},
                 {"running": 0, "memory_reserved_bytes": 0, "waiting_for_memory": 0},
                 {"running": 4, "memory_reserved_bytes": 160 * MB, "waiting_for_memory": 1}]
    assert s.summary() == {"reserved_per_row_mb": 50, "waiting_for_memory_max": 3}
    s.samples = [{"running": 1}]  # an engine without memory figures
    assert s.summary() == {}


def test_code_version_names_a_commit():
    from tandem_tools.bench_diffusion import code_version

    v = code_version()
    assert v and " " not in v
