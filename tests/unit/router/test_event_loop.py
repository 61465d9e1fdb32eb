"""`tandem router --event-loop`: the loop it names runs the router, or the flag is refused."""
from __future__ import annotations

import asyncio
import sys

import pytest

from tandem.router import server as router_server


def test_asyncio_is_the_default():
    args = router_server.build_parser().parse_args(["--model", "/m", "--both", "w:1"])
    assert router_server.event_loop_runner(args.event_loop) is asyncio.run


def test_uvloop_without_the_package_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    code = router_server.main(["--model", "/m", "--both", "127.0.0.1:1", "--processes", "1",
                               "--event-loop", "uvloop"])
    assert code == 2
    assert "tandem[uvloop]" in capsys.readouterr().err


def test_uvloop_runs_the_coroutine():
    uvloop = pytest.importorskip("uvloop")

    async def loop_type():
        return type(asyncio.get_running_loop())

    assert router_server.event_loop_runner("uvloop")(loop_type()) is uvloop.Loop
