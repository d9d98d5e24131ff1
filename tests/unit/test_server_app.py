"""The server object's lifecycle over an engine stand-in (``server_scenarios.py``, in its own
process): parts acquired in order, released in reverse, and released too when a start fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _scenario(name: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.unit.server_scenarios", name], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _first_words(lines: list[str]) -> list[str]:
    return [line.split(":")[0].split(" ")[0] for line in lines]


def test_a_requested_stop_drains_then_releases_every_port() -> None:
    report = _scenario("requested-stop")
    assert report["ready"] and report["models"] == ["m", "m-text"]
    assert report["accepting_while_serving"] == [True, True, True]  # gRPC, /metrics, HTTP
    assert _first_words(report["lines"]) == ["listening", "ready", "stopping", "stopping", "HTTP", "stopped;"]
    assert report["lines"][-2] == "HTTP inference requests answered: none"
    assert "serving 0.01 s more" in report["lines"][2]
    assert "; batching up to 4 rows, 2.0 ms delay;" in report["lines"][1]  # padded: rows bound its batches
    assert report["lines"][-1] == "stopped; ModelInfer calls answered: none"  # said once
    assert not report["ready_after"] and report["accepting_after"] == [False, False, False]


def test_a_stop_nobody_requested_does_not_drain() -> None:
    report = _scenario("unrequested-stop")
    assert _first_words(report["lines"]) == ["listening", "ready", "stopping", "HTTP", "stopped;"]
    assert report["accepting_after"] == [False, False, False]


def test_a_failed_load_releases_what_start_acquired_and_raises() -> None:
    report = _scenario("failed-load")
    assert report["error"] == "no such artifact"
    assert _first_words(report["lines"]) == ["listening", "stopping", "HTTP", "stopped;"]
    assert report["accepting_after"] == [False, False, False]


def test_several_artifacts_are_each_served_as_two_models_and_ready_once_all_are_loaded() -> None:
    report = _scenario("two-models")
    assert report["ready"] and report["models"] == ["m", "m-text", "n", "n-text"]
    assert report["lines"][1].startswith("ready: models 'm' (token ids) and 'm-text' (text), "
                                         "'n' (token ids) and 'n-text' (text);")
    # 'n' is packed: its batches are bounded by their tokens as well
    assert "; batching up to 4 rows and 2048 tokens, 2.0 ms delay;" in report["lines"][1]
    assert report["accepting_after"] == [False, False, False]
