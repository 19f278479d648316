"""Start and stop an SGLang server as a subprocess (used by the demo and the GPU test scripts)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# On Hopper without flash-attention 3 wheels these are the backends known to work (shared notes).
DEFAULT_ARGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch")


def free_port() -> int:
    """A local TCP port nothing listens on now (for a server or a process group's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(model_path: str | Path, port: int, extra: list[str] | tuple[str, ...] = (),
           env: dict[str, str] | None = None, log_path: str | Path | None = None) -> subprocess.Popen:
    """Start a server in a process group of its own (setsid). A port that is already taken is refused here: otherwise
    a server left running by an earlier run answers the health check and is mistaken for the new one."""
    with socket.socket() as probe:
        # as the server binds (SO_REUSEADDR): a port left in TIME_WAIT by the last run's connections is free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as e:
            raise RuntimeError(f"port {port} is already in use ({e.strerror}): a server left from an earlier run? "
                               "Stop it or pick another port") from None
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", "127.0.0.1", "--port", str(port), *DEFAULT_ARGS, *extra]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)
    proc.cmd = cmd  # type: ignore[attr-defined]
    return proc


def post(url: str, payload: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(base_url: str, proc: subprocess.Popen, timeout: float = 900) -> float:
    """Seconds until /health_generate answers 200; raises if the server dies or times out."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"SGLang server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base_url + "/health_generate", timeout=30) as r:
                if r.status == 200:
                    return time.time() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise TimeoutError(f"SGLang server at {base_url} not ready after {timeout:.0f}s")


def stop(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
