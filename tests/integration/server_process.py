"""A real ``python -m dietserve serve`` process on 127.0.0.1 with ephemeral ports.

The test process never imports dietserve.server._proto: its messages share the ``inference``
protobuf package with tritonclient's, and one process cannot register both.
"""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

LISTENING = re.compile(r"listening grpc=(\S+)(?: health=(\S+))? metrics=(\S+)(?: http=(\S+))?")
REPO_ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    def __init__(self, artifact: Path | None, *flags: str, model_name: str | None = "minilm",
                 command: list[str] | None = None, env: dict[str, str] | None = None,
                 ready_timeout: float = 180.0):
        """``artifact`` None: the flags name what to serve (``--artifact-store``, several
        ``--artifact``). ``model_name`` None: the manifests' names. ``env``: the process's
        environment (default: this one's). ``ready_timeout``: seconds to wait for loading and
        warm-up."""
        self.model_name = model_name
        source = ["--artifact", str(artifact)] if artifact is not None else []
        naming = ["--model-name", model_name] if model_name is not None else []
        command = command or [sys.executable, "-m", "dietserve", "serve", *source, *naming,
                              "--port", "0", "--metrics-port", "0", "--http-port", "0", *flags]
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._events: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_log, daemon=True).start()
        self.grpc_url, self.health_url, self.metrics_url, self.http_url = self._wait_for(LISTENING).groups()
        self._wait_for(re.compile(r"ready: model"), ready_timeout)

    def _read_log(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line.rstrip())
            self._events.put(line)
        self._events.put("")

    def _wait_for(self, pattern: re.Pattern, timeout: float = 180.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._events.get(timeout=1.0)
            except queue.Empty:
                continue
            if line == "":
                raise RuntimeError("server exited:\n" + "\n".join(self.lines))
            if match := pattern.search(line):
                return match
        raise TimeoutError(f"server did not print {pattern.pattern!r}:\n" + "\n".join(self.lines))

    def log(self) -> str:
        return "\n".join(self.lines)

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0) -> int:
        return self.process.wait(timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
