"""Tiny runs of the benchmarks in bench/: the JSON line parses and the figures are sane.

No timing assertions: only that each bench runs end to end and reports positive numbers.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support import zygote
from tests.support.browser import require_chromium

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(autouse=True)
def forked_services(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benches' `python -m service ...` processes (serve, sim-worker) fork from this test
    process's zygote, without their imports: the smoke runs start dozens."""
    import bench.common

    exec_launch = bench.common.launch

    def launch(arguments: Sequence[str], env: Mapping[str, str], log: Path) -> object:
        if list(arguments[:2]) == ["-m", "service"]:
            return zygote.launch(arguments[2:], env, bench.common.REPO, log)
        return exec_launch(arguments, env, log)

    monkeypatch.setattr(bench.common, "launch", launch)


def load_bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def last_json_line(output: str) -> dict[str, Any]:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    return result


def assert_positive(result: dict[str, Any], *keys: str) -> None:
    for key in keys:
        assert key in result, key
        assert isinstance(result[key], (int, float)) and result[key] > 0, (key, result[key])


def test_turn_overhead_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("turn_overhead")
    returned = bench.main(["--quick"])
    result = last_json_line(capsys.readouterr().out)
    assert result == json.loads(json.dumps(returned))
    assert result["turns"] == 4 and result["tools"] == 16
    assert_positive(
        result,
        "seed_ms",
        "ours_ms",
        "ratio",
        "orchestrator_ratio",
        "ours_ms_per_turn",
        "system_prompt_chars",
        "final_tokens",
    )
    # Both pipelines account the same conversation, give or take re-tokenization drift.
    assert abs(result["final_tokens"] - result["seed_final_tokens"]) < 0.05 * result["final_tokens"]


def test_batch_pull_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("batch_pull")
    bench.main(["--quick"])
    result = last_json_line(capsys.readouterr().out)
    assert result["episodes"] == 16
    assert_positive(
        result,
        "arrow_bytes",
        "arrow_s",
        "arrow_mb_per_s",
        "json_bytes",
        "json_s",
        "json_mb_per_s",
        "ratio",
        "verified_episodes",
        "service_rss_mb",
        "arrow_peak_rss_mb",
        "json_peak_rss_mb",
    )
    assert result["json_path"]
    assert len(result["arrow_runs_s"]) == 5


@pytest.mark.slow
def test_concurrency_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("concurrency")
    bench.main(["--quick"])
    result = last_json_line(capsys.readouterr().out)
    assert result["episodes"] == 50
    assert sum(result["statuses"].values()) == 50
    assert "failed" not in result["statuses"]
    assert_positive(
        result,
        "wall_s",
        "episodes_per_s",
        "ideal_episodes_per_s",
        "efficiency",
        "turns",
        "loop_lag_max_ms",
        "idle_loop_lag_max_ms",
    )


@pytest.mark.postgres
@pytest.mark.usefixtures("postgres_template")  # skips (or fails) as the other postgres tests do
def test_polling_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("polling")
    bench.main(["--quick", "--latency", "0.05", "--api-processes", "1"])
    result = last_json_line(capsys.readouterr().out)
    assert result["episodes"] == 200 and result["api_processes"] == 1
    assert result["server_errors"] == 0 and result["statuses"].get("200", 0) == result["requests"]
    assert_positive(result, "requests", "get_p50_ms", "baseline_get_p50_ms", "health_samples")


@pytest.mark.postgres
@pytest.mark.usefixtures("postgres_template")
def test_outage_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("outage")
    bench.main(["--outage", "2", "--episodes", "8", "--latency", "0.2"])
    result = last_json_line(capsys.readouterr().out)
    assert result["episodes"] == 8 and sum(result["statuses"].values()) == 8
    assert (result["rerun"], result["failures"]) == (0, 0)
    assert result["answers_during_outage"]


def test_soak_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("soak")
    bench.main(["--minutes", "3", "--sample-seconds", "3", "--in-flight", "128", "--latency", "0.02",
                "--update-every", "3", "--cancel-every", "5", "--database", "sqlite"])  # fmt: skip
    result = last_json_line(capsys.readouterr().out)
    assert len(result["samples"]) == 3 and result["episodes_accepted"] > 0
    assert (result["episodes_lost"], result["groups_duplicated"], result["errors"]) == (0, 0, {})
    assert result["groups_streamed"] > 0 and result["weight_updates"] >= 1
    assert all(sample["rss_mib"] > 0 and sample["fds"] > 0 for sample in result["samples"])


@pytest.mark.slow
def test_weight_update_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("weight_update")
    bench.main(["--episodes", "16", "--updates", "2", "--interval", "1", "--latency", "0.1"])
    result = last_json_line(capsys.readouterr().out)
    resumed, not_resumed = result["resumed"], result["not_resumed"]
    assert resumed["complete"] and sum(resumed["counts"].values()) == 16
    assert (resumed["episodes_lost"], resumed["tokens_sampled_twice"]) == (0, 0)
    # Each update waits for a turn in flight and aborts again until it cut one: without resumes, an
    # episode whose turn was cut is lost.
    assert resumed["requests_cut"] > 0 < not_resumed["requests_cut"]
    assert resumed["resumed_calls"] > 0 and not_resumed["episodes_lost"] > 0
    assert len(resumed["abort_loops"]) == 2


@pytest.mark.slow
def test_weight_update_with_sticky_placement_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("weight_update")
    bench.main(["--episodes", "16", "--updates", "2", "--interval", "1", "--latency", "0.1", "--workers", "2",
                "--resumed-only"])  # fmt: skip
    result = last_json_line(capsys.readouterr().out)
    assert "not_resumed" not in result and result["workers"] == 2
    resumed = result["resumed"]
    assert resumed["complete"] and sum(resumed["counts"].values()) == 16
    assert (resumed["episodes_lost"], resumed["tokens_sampled_twice"]) == (0, 0)


def test_long_horizon_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("long_horizon")
    bench.main(["--context", "9000", "--repeats", "1"])
    result = last_json_line(capsys.readouterr().out)
    assert all(result[f"turn_{turn}_cpu_ms"] > 0 for turn in (8, 32, 128))


def test_long_horizon_external_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("long_horizon")
    bench.main(["--path", "external", "--context", "9000", "--repeats", "1"])
    result = last_json_line(capsys.readouterr().out)
    assert result["path"] == "external" and result["database"] == "sqlite"
    assert all(result[f"turn_{turn}_cpu_ms"] > 0 for turn in (8, 32, 128))


def test_prefix_cache_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("prefix_cache")
    bench.main(["--groups", "4", "--samples", "4", "--workers", "2"])
    result = last_json_line(capsys.readouterr().out)
    sticky, spread = result["sticky"], result["round_robin"]
    assert sticky["complete"] and spread["complete"]
    assert sticky["metrics_hit_rate"] == sticky["hit_rate"]  # the service records what the engine said
    assert sticky["prefilled_tokens"] < spread["prefilled_tokens"]


def test_stragglers_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("stragglers")
    returned = bench.main(["--groups", "2", "--latency", "0.01", "--deadline", "0.5"])
    result = last_json_line(capsys.readouterr().out)
    assert result == json.loads(json.dumps(returned))
    for way in ("whole_batch", "stream", "stream_deadline"):
        assert sorted(result[way]["seconds_to_k_groups"]) == ["1", "2"]
        assert sum(result[way]["counts"].values()) == 2 * result["samples"]
    assert_positive(result["speedup_vs_whole_batch"]["stream"], "1", "2")


def test_slime_step_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("slime_step")
    returned = bench.main(["--steps", "1", "--batch-size", "2", "--latency", "0.01"])
    result = last_json_line(capsys.readouterr().out)
    assert result == json.loads(json.dumps(returned))
    for way in ("summary_polling", "groups_long_poll"):
        assert_positive(result[way], "seconds_per_step", "requests_per_step", "mb_read_per_step")
    # the baseline asks for each episode on its own: at least one request per sample it used
    assert result["summary_polling"]["requests_per_step"] > 2 * result["samples"]
    assert_positive(result, "step_speedup", "fewer_requests")


def test_viewer_quick(capsys: pytest.CaptureFixture[str]) -> None:
    require_chromium()
    bench = load_bench("viewer")
    returned = bench.main(["--groups", "3", "--tokens", "400", "--repeat", "1"])
    result = last_json_line(capsys.readouterr().out)
    assert result == json.loads(json.dumps(returned))
    assert result["episodes"] == 24
    assert_positive(result, "batch_page_ms", "batch_fetch_ms", "token_view_ms", "token_fetch_ms")
    assert len(result["runs"]["token_view"]) == 1


@pytest.mark.parametrize("protocol", ["chat", "messages", "responses"])
def test_agents_quick(capsys: pytest.CaptureFixture[str], protocol: str) -> None:
    bench = load_bench("agents")
    returned = bench.main(["--agents", "4", "--calls", "2", "--latency", "0.02", "--protocol", protocol])
    result = last_json_line(capsys.readouterr().out)
    assert result == json.loads(json.dumps(returned))
    assert result["outcomes"] == {"ok": 4} and result["stored"] == {"completed, 2 calls": 4}
    assert result["complete"] and result["segments_of_first"] == 1 and result["protocol"] == protocol
    assert_positive(result, "calls_per_s", "service_cpu_ms_per_call", "bare_client_cpu_ms_per_call")


def test_trainer_adapters_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("trainer_adapters")
    returned = bench.main(
        ["--groups", "2", "--samples", "2", "--steps", "1", "--repeats", "1", "--latency", "0.01"]
    )
    result = last_json_line(capsys.readouterr().out)
    assert result == json.loads(json.dumps(returned))
    for way in ("bare_client", "slime", "verl", "trl", "skyrl", "areal", "openrlhf"):
        assert_positive(result[way], "cold_seconds", "warm_seconds", "warm_cpu_seconds")
        assert 0 <= result[way]["cold_tail_seconds"] < result[way]["cold_seconds"]
    assert "max_overhead_of_step" in result and result["verl_vs_slime_cold"] > 0
    assert {"overhead_goal_met", "verl_vs_slime_goal_met"} <= result.keys()
    assert len(result["load_average_before"]) == 3


def test_the_capacity_proxy_closes_the_connections_it_holds_when_it_stops() -> None:
    """The proxy stops (after the service) with connections it has not yet seen end: it closes both
    ends itself, so none is left in its closed event loop for the garbage collector (a
    ResourceWarning failing some later test: `unclosed <socket.socket ... raddr=(..., 5432)>`)."""
    bench = load_bench("capacity")
    with socket.create_server(("127.0.0.1", 0)) as upstream:
        upstream.settimeout(5)
        with bench.CountingProxy(upstream.getsockname()) as proxy:
            client = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
            accepted, _ = upstream.accept()  # the proxy's own connection on, open when it stops
        with client, accepted:
            accepted.settimeout(5)
            assert accepted.recv(1) == b"" and client.recv(1) == b""  # closed by the proxy: EOF
    assert proxy.traffic.connections == 1


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.usefixtures("postgres_template")
def test_capacity_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("capacity")
    bench.main(["--quick"])
    result = last_json_line(capsys.readouterr().out)
    assert [run["processes"] for run in result["runs"]] == [1, 2]
    for run in result["runs"]:
        assert run["finished"] == run["episodes"] == 100 and run["complete"]
        # The proxy read the protocol: statements and bytes each way, and the server counted commits.
        assert_positive(
            run, "statements_per_turn", "bytes_to_db_per_turn", "bytes_from_db_per_turn", "commits"
        )
    assert_positive(result["projection"], "turns_per_s_one_pg_carries", "service_processes_one_pg_carries")


def test_engines_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("engines")
    returned = bench.main(["--quick"])
    result = last_json_line(capsys.readouterr().out)
    assert result == json.loads(json.dumps(returned))
    assert [run["engine"] for run in result["runs"]] == ["sglang", "vllm"]
    for run in result["runs"]:
        assert run["complete"] and run["episodes"] == 50 and "failed" not in run["statuses"]
        assert run["logprobs_modes"] == ["processed"]  # SGLang's default; the simulated vLLM's flag
        assert_positive(run, "generate_calls", "service_cpu_ms_per_turn")
    assert_positive(
        result, "service_cpu_ms_per_turn_vllm", "service_cpu_ms_per_turn_sglang", "vllm_over_sglang"
    )


@pytest.mark.slow
def test_remote_envs_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("remote_envs")
    report = bench.main(["--quick"])
    assert last_json_line(capsys.readouterr().out) == report
    assert report["remote"]["errors"] == 0 and report["remote"]["sessions_open_on_servers_after"] == 0
    assert report["remote"]["server_sessions_opened"] < report["remote"]["episodes"]  # sessions reused
    assert report["overhead"]["server_handler_ms"]["samples"] > 0
    assert report["remote"]["cpu_ms_per_env_call"] > 0 < report["baseline_thread"]["cpu_ms_per_env_call"]
    # The baselines run the same episodes without error: the process one's env workers import the
    # env's class whatever name the bench was loaded under here.
    assert report["baseline_thread"]["errors"] == 0 == report["baseline_process"]["errors"]
    assert report["cpu_ratio_vs_process"] is not None and report["cpu_ratio_vs_process"] > 0
    assert report["kill"]["lost"] == 0 and report["kill"]["reward_1"] == report["kill"]["episodes"]


def test_http_floor_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("http_floor")
    report = bench.main(["--episodes", "200"])
    assert last_json_line(capsys.readouterr().out) == report
    # Half the episodes make one call, half two: every answer streamed to its [DONE].
    assert report["episodes"] == 200 and report["requests"] == 300 == report["answers_streamed_to_end"]
    assert_positive(report, "server_cpu_ms_per_request", "seconds")
