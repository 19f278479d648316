"""The server launcher refuses a port that is already taken (a stale server would pass the health check)."""

from __future__ import annotations

import socket

import pytest

from sglang_exl3.integration.server import launch


def test_launch_refuses_a_port_in_use(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} is already in use"):
            launch(tmp_path, port, log_path=tmp_path / "server.log")
    assert not (tmp_path / "server.log").exists()  # refused before anything started
