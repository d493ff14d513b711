import math
import os
import subprocess
import sys

import pytest

from tandem_tools.bench import procstat, vllm_bench
from tandem_tools.bench.loadgen import percentile
from tandem_tools.bench.main import format_table, num_prompts, round_order, summarize
from tandem_tools.bench.setups import _vllm_flags, missing_binaries, router_argv
from tandem_tools.bench.vllm_bench import LevelResult, LevelSpec, bench_serve_argv, cpu_delta, parse_result
from tandem_tools.cli import build_parser


def test_percentile():
    assert percentile([3, 1, 2], 0.5) == 2
    assert percentile([0, 10], 0.99) == 9.9
    assert math.isnan(percentile([], 0.5))


def test_vllm_flags_mirror_engine_args():
    assert _vllm_flags({"enforce_eager": True, "max_model_len": 512, "x": False}) == [
        "--enforce-eager", "--max-model-len", "512"]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_bench_serve_argv_fixes_lengths_and_saves_percentiles(tmp_path):
    spec = LevelSpec("http://127.0.0.1:9", "tiny-llama", "/m/tiny-llama", concurrency=8, num_prompts=32,
                     input_len=32, output_len=64, seed=3)
    argv = bench_serve_argv(spec, tmp_path, "x.json")
    assert argv[:5] == [sys.executable, "-m", "tandem_tools.vllm_cli_shim", "bench", "serve"]
    assert "--ignore-eos" in argv and "--save-result" in argv
    expected = {"--backend": "openai-chat", "--endpoint": "/v1/chat/completions", "--base-url": "http://127.0.0.1:9",
                "--model": "tiny-llama", "--tokenizer": "/m/tiny-llama", "--dataset-name": "random",
                "--random-input-len": "32", "--random-output-len": "64", "--random-range-ratio": "0",
                "--max-concurrency": "8", "--num-prompts": "32", "--num-warmups": "8", "--seed": "3",
                "--metric-percentiles": "50,99", "--result-dir": str(tmp_path), "--result-filename": "x.json"}
    assert {k: _flag(argv, k) for k in expected} == expected
    assert set(_flag(argv, "--percentile-metrics").split(",")) >= {"ttft", "itl"}


RESULT = {"max_concurrency": 8, "completed": 32, "failed": 0, "duration": 1.36, "total_output_tokens": 2048,
          "output_throughput": 1506.3, "p50_ttft_ms": 50.1, "p99_ttft_ms": 61.2, "median_ttft_ms": 50.1,
          "p50_itl_ms": 4.54, "p99_itl_ms": 15.3, "p50_tpot_ms": 4.78, "itls": [[0.004]]}


def test_parse_result_and_cpu_per_request_and_per_1k_tokens():
    r = parse_result(RESULT, cpu={"gateway": 0.512, "serving": 1.024})
    assert (r.concurrency, r.completed, r.output_tokens, r.output_tok_s) == (8, 32, 2048, 1506.3)
    assert (r.ttft_p50_ms, r.ttft_p99_ms, r.itl_p50_ms, r.tpot_p50_ms) == (50.1, 61.2, 4.54, 4.78)
    assert r.cpu_ms_per_request("gateway") == pytest.approx(16.0)  # 512 ms over 32 requests
    assert r.cpu_ms_per_1k_tokens("gateway") == pytest.approx(250.0)  # 512 ms over 2.048 k tokens
    assert r.cpu_ms_per_1k_tokens("serving") == pytest.approx(500.0)
    assert r.cpu_ms_per_request("nope") is None
    assert parse_result({**RESULT, "completed": 0, "total_output_tokens": 0}, {"gateway": 1.0}).cpu_ms_per_1k_tokens(
        "gateway") is None
    old = parse_result({k: v for k, v in RESULT.items() if k != "p50_ttft_ms"})
    assert old.ttft_p50_ms == 50.1  # falls back to the median
    assert cpu_delta({"a": 1.0, "b": 2.0}, {"a": 1.5, "b": 1.0}) == {"a": 0.5, "b": 0.0}  # a pid reused: not < 0


def test_run_level_samples_cpu_between_the_markers(tmp_path, monkeypatch):
    script = (f"import json, sys; print('warming up'); print({vllm_bench.START_MARK!r}); "
              f"print('=== ' + {vllm_bench.END_MARK!r} + ' ==='); "
              f"json.dump({RESULT!r}, open(sys.argv[1] + '/' + sys.argv[2], 'w'))")
    monkeypatch.setattr(vllm_bench, "bench_serve_argv", lambda spec, d, f: [sys.executable, "-c", script, str(d), f])
    reads = iter([0.0, 1.0, 3.5, 9.0])  # at the start of the process, at the start mark, at the end mark
    r = vllm_bench.run_level(LevelSpec("http://x", "m", "/m", 8, 32, 32, 64), tmp_path,
                             lambda: {"gateway": next(reads)}, "t")
    assert r.cpu_s == {"gateway": 2.5} and r.cpu_window == "measured requests"
    assert r.output_tokens == 2048
    assert (tmp_path / "t.bench.log").read_text().startswith("warming up")


def test_run_level_without_markers_measures_the_whole_process(tmp_path, monkeypatch):
    script = f"import json, sys; json.dump({RESULT!r}, open(sys.argv[1] + '/' + sys.argv[2], 'w'))"
    monkeypatch.setattr(vllm_bench, "bench_serve_argv", lambda spec, d, f: [sys.executable, "-c", script, str(d), f])
    reads = iter([1.0, 4.0])
    r = vllm_bench.run_level(LevelSpec("http://x", "m", "/m", 1, 1, 1, 1), tmp_path, lambda: {"g": next(reads)}, "t")
    assert r.cpu_s == {"g": 3.0} and r.cpu_window == "whole bench process"


def test_run_level_reports_a_failed_bench(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_bench, "bench_serve_argv", lambda spec, d, f: [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="vllm bench serve failed"):
        vllm_bench.run_level(LevelSpec("http://x", "m", "/m", 1, 1, 1, 1), tmp_path, dict, "t")


def test_router_argv_round_robin_one_worker_own_metrics_port():
    vr = router_argv("vllm-router", 8123, 8124, 8125)
    smg = router_argv("smg", 8123, 8124, 8125)
    assert vr[0].endswith("vllm-router") and smg[0].endswith("smg") and smg[1] == "launch"
    for argv in (vr, smg):
        assert (_flag(argv, "--port"), _flag(argv, "--worker-urls"), _flag(argv, "--policy"),
                _flag(argv, "--prometheus-port")) == ("8123", "http://127.0.0.1:8124", "round_robin", "8125")
    with pytest.raises(ValueError):
        router_argv("nginx", 1, 2, 3)
    assert missing_binaries(["direct", "tandem"]) == []


def test_rounds_rotate_the_order_and_levels_get_enough_prompts():
    assert [round_order(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert [num_prompts(0, c) for c in (1, 8, 32)] == [32, 32, 128]
    assert num_prompts(10, 32) == 10


def _level(tok_s: float, ttft: float, gateway: float | None = None, serving: float = 1.0, failed: int = 0):
    cpu = {"serving": serving, **({"gateway": gateway} if gateway is not None else {})}
    return LevelResult(concurrency=1, completed=100, failed=failed, duration_s=10, output_tokens=1000,
                       output_tok_s=tok_s, ttft_p50_ms=ttft, ttft_p99_ms=2 * ttft, itl_p50_ms=4.0,
                       tpot_p50_ms=4.0, cpu_s=cpu)


def test_ratios_are_medians_of_per_round_ratios_to_direct():
    results = {"direct": [{1: _level(100, 10)}, {1: _level(200, 10)}],
               "tandem": [{1: _level(90, 15, gateway=0.5)}, {1: _level(200, 11, gateway=0.7, failed=2)}]}
    s = summarize(results, [1])
    assert s["tandem"][1]["out tok/s"] == (145, pytest.approx(0.95))  # rounds 0.9x and 1.0x
    assert s["direct"][1]["out tok/s"] == (150, None)
    assert s["tandem"][1]["TTFT p50 ms"] == (13, pytest.approx(1.3))
    assert s["tandem"][1]["gateway CPU ms/request"] == (pytest.approx(6.0), None)  # 0.6 s / 100 requests
    assert s["tandem"][1]["gateway CPU ms/1k tok"] == (pytest.approx(600.0), None)
    assert s["tandem"][1]["gateway+serving CPU ms/1k tok"] == (pytest.approx(1600.0), pytest.approx(1.6))
    assert s["direct"][1]["gateway CPU ms/1k tok"] == (None, None)
    assert s["tandem"][1]["failed"] == 2

    table = format_table(results, [1])
    assert table.splitlines()[0] == "| c | metric | direct | tandem |"
    assert "| 1 | out tok/s | 150 | 145 (0.95x) |" in table
    assert "| 1 | gateway CPU ms/request | - | 6.00 |" in table
    assert "| 1 | failed requests | tandem: 2 |" in table


def test_help_explains_every_command():
    parser = build_parser()
    text = parser.format_help()
    for cmd in ("serve", "build-tiny-models", "bench"):
        assert cmd in text


def test_procstat_sees_this_process_and_its_children():
    # the child says it runs (its command line is in place only once exec has finished)
    child = subprocess.Popen([sys.executable, "-c", "print('up', flush=True); import sys; sys.stdin.read()",
                              "procstat-marker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout.readline() == b"up\n"
    try:
        assert child.pid in procstat.tree(os.getpid())
        assert procstat.find(os.getpid(), sys.executable + " -c") == child.pid
        assert "procstat-marker" in procstat.cmdline(child.pid)
    finally:
        child.communicate(b"")
    t0 = procstat.cpu_s(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert procstat.cpu_s(os.getpid()) > t0
    assert procstat.cpu_s(2**22 + 12345) == 0.0 and procstat.find(2**22 + 12345, "x") is None


# -- the diffusion benchmark's helpers ----------------------------------------------------------
def test_proc_readers_see_this_process_and_its_children():
    import os
    import subprocess
    import sys

    from tandem_tools.bench.diffusion import proc_cpu_s, proc_mem, proc_tree, reset_peak

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
    from tandem_tools.bench.diffusion import MB, memory_per_row, num_requests

    m = memory_per_row(100 * MB, 500 * MB, 300 * MB, 4)
    assert (m["peak_growth_per_row_mb"], m["mean_growth_per_row_mb"], m["rss_before_mb"]) == (100, 50, 100)
    assert memory_per_row(100 * MB, 50 * MB, 0, 0)["peak_growth_per_row_mb"] == 0  # never negative
    assert [num_requests(0, c) for c in (1, 4, 8)] == [4, 8, 16]  # the tiny model's default
    assert [num_requests(2, c) for c in (1, 4)] == [2, 4]  # at least one round of c


def test_diffusion_bodies_carry_steps_and_seeds():
    from tandem_tools.bench.diffusion import bodies

    a = bodies("m", 3, 256, seed=4, steps=8)
    assert a == bodies("m", 3, 256, seed=4, steps=8)
    assert all(b["diffusion"] == {"max_denoising_steps": 8} and b["max_tokens"] == 256 for b in a)
    assert len({b["seed"] for b in a}) == 3
    assert "diffusion" not in bodies("m", 1, 32, seed=1)[0]


def test_tandem_config_sets_the_sampler_and_one_thread():
    import argparse

    from tandem_tools.bench.diffusion import tandem_config

    args = argparse.Namespace(port=9, memory_budget_gib=0)
    exact = tandem_config(args, "m", "/p", "exact", "row", 4)["models"][0]["engine_args"]
    assert exact == {"family": "diffusiongemma", "max_batch": 4, "boundaries": "row", "num_threads": 1}
    args.memory_budget_gib = 3.5
    fast = tandem_config(args, "m", "/p", "fast", "block", 4)["models"][0]["engine_args"]
    assert fast["sampler"] == "fast" and fast["memory_budget_gib"] == 3.5


def test_levels_and_model_names():
    import argparse

    from tandem_tools.bench.diffusion import _model, levels_for

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
    from tandem_tools.bench.diffusion import fifo_latencies

    assert fifo_latencies([1.0, 1.0, 1.0], 1) == [1.0, 1.0, 1.0]
    assert fifo_latencies([1.0, 1.0], 2) == [1.0, 2.0]  # the second client waits for the first


def test_diffusion_table_has_ratios_to_hf_sequential_and_skips():
    from tandem_tools.bench.diffusion import format_table

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
    from tandem_tools.bench.diffusion import MB, EngineSampler

    s = EngineSampler("http://127.0.0.1:9", "m")
    s.samples = [{"running": 2, "memory_reserved_bytes": 100 * MB, "waiting_for_memory": 3},
                 {"running": 0, "memory_reserved_bytes": 0, "waiting_for_memory": 0},
                 {"running": 4, "memory_reserved_bytes": 160 * MB, "waiting_for_memory": 1}]
    assert s.summary() == {"reserved_per_row_mb": 50, "waiting_for_memory_max": 3}
    s.samples = [{"running": 1}]  # an engine without memory figures
    assert s.summary() == {}


def test_code_version_names_a_commit():
    from tandem_tools.bench.diffusion import code_version

    v = code_version()
    assert v and " " not in v


def test_hoptrace_takes_each_hops_first_time_in_its_request_window():
    from tandem_tools.bench.hoptrace import first_in_windows, format_hops, hop_table

    events = [(5, "g_asgi_in"), (10, "g_asgi_in"), (12, "g_body"), (13, "g_body"), (30, "g_asgi_in"), (34, "g_body")]
    per_request = first_in_windows(events, [(10, 20), (30, 40)])
    assert per_request == [{"g_asgi_in": 0, "g_body": 2}, {"g_asgi_in": 0, "g_body": 4}]
    per_request = [{"g_asgi_in": 1_000_000, "g_body": 3_000_000, "c_first": 10_000_000},
                   {"g_asgi_in": 1_000_000, "g_body": 5_000_000, "c_first": 12_000_000}]
    rows = hop_table(per_request)
    assert [(r[0], r[2], r[3]) for r in rows] == [("g_asgi_in", 1.0, 1.0), ("g_body", 4.0, 3.0),
                                                  ("c_first", 11.0, 7.0)]
    table = format_hops({"tandem": rows, "direct": [("c_first", "", 9.0, 9.0)]})
    assert "| body intake (read + JSON) | 3.00 (4.00) | - |" in table
    assert "| SSE out (-> client's first event) | 7.00 (11.00) | 9.00 (9.00) |" in table


def test_transport_bench_rows():
    from tandem_tools.bench.transport import format_rows

    r = {"call": [1_000_000, 2_000_000, 3_000_000], "item": [500_000] * 3, "cpu": (0.003, 0.006)}
    assert format_rows({"ray": r}, 3).splitlines()[-1] == "| ray | 2.00 / 2.00 | 0.50 / 0.50 | 1.000 / 2.000 |"


def test_hoptrace_stage_gaps_show_where_a_stall_starts():
    from tandem_tools.bench.hoptrace import format_gaps, stage_gaps

    ms = 1_000_000
    events = [(t * ms, "v_output") for t in (0, 2, 4, 6)] + [(t * ms, "g_feed") for t in (1, 3, 40, 42)]
    gaps = stage_gaps(events, [(0, 50 * ms)])
    assert gaps["v_output"] == (2.0, 2.0, 2.0) and gaps["g_feed"] == (2.0, 2.0, 37.0)  # the stall: its max
    assert "| gateway receives a batch | 2.00 / 2.00 / 37.0 |" in format_gaps({"t": gaps})


def test_bench_parsing_runs_and_parses_every_call(capsys):
    """The parser benchmark at a small size: its own check (every finished call parsed) holds and it
    prints the three text paths."""
    from tandem_tools.bench.parsing import main

    main(["--tokens", "600", "--canvas", "64", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "600 tokens in 10 blocks of 64" in out
    assert all(name in out for name in ("plain", "raw", "parsed"))


def test_bench_sampling_runs_on_the_tiny_model(capsys):
    """The sampling-fields benchmark at a small size: every setup runs and the tables print."""
    from tandem_tools.bench.sampling import main

    main(["--model", "tiny-diffusiongemma", "--rounds", "1", "--concurrency", "2", "--steps", "2",
          "--max-tokens", "32", "--score-tokens", "70", "--micro", "--variants", "none,top_p=0.9,min_tokens=256"])
    out = capsys.readouterr().out
    assert "| fast | 2 | top_p=0.9 |" in out and "| exact | 1 | min_tokens=256 |" in out
    assert "CPU ms per scored token" in out and "tokens kept per position" in out
