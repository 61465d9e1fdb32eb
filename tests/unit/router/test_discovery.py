"""Worker targets: static addresses, DNS names re-resolved, and files."""
from __future__ import annotations

import asyncio
import logging
import os
import socket

import pytest

from tandem.router.discovery import LookupFailed, Target
from tandem.router.ejection import HealthPolicy
from tandem.router.worker_pool import WorkerPool


def test_targets_parse_and_resolve(tmp_path):
    assert asyncio.run(Target.parse("10.0.0.5:7001").resolve()) == ["10.0.0.5:7001"]
    resolved = asyncio.run(Target.parse("dns:///localhost:7002").resolve())
    assert "127.0.0.1:7002" in resolved
    assert asyncio.run(Target.parse("dns:///no-such-host.invalid:7002").resolve()) == []
    listing = tmp_path / "workers.txt"
    listing.write_text("127.0.0.1:1\n\n127.0.0.1:2\n")
    assert asyncio.run(Target.parse(f"file://{listing}").resolve()) == ["127.0.0.1:1",
                                                                         "127.0.0.1:2"]
    with pytest.raises(LookupFailed, match="cannot read .*missing"):
        asyncio.run(Target.parse(f"file://{tmp_path / 'missing'}").resolve())
    for bad in ("no-port", "dns:///name", "host:http"):
        with pytest.raises(ValueError, match="host:port"):
            Target.parse(bad)


def test_pool_adds_and_retires_workers_as_the_target_changes(tmp_path):
    listing = tmp_path / "decode.txt"
    listing.write_text("127.0.0.1:1\n")

    async def scenario():
        pool = WorkerPool(["127.0.0.1:9"], [f"file://{listing}"], [],
                          HealthPolicy(check_interval_seconds=60))
        added = []
        pool.on_added.append(added.append)
        await pool.refresh()
        assert sorted(w.address for w in pool.workers) == ["127.0.0.1:1", "127.0.0.1:9"]
        assert sorted(w.address for w in added) == ["127.0.0.1:1", "127.0.0.1:9"]
        added.clear()
        listing.write_text("127.0.0.1:1\n127.0.0.1:2\n")
        await pool.refresh()
        assert [w.address for w in added] == ["127.0.0.1:2"]
        retiring = next(w for w in pool.workers if w.address == "127.0.0.1:1")
        retiring.num_in_flight = 1  # a request still running there keeps it until it ends
        listing.write_text("127.0.0.1:2\n")
        await pool.refresh()
        assert retiring in pool.workers and retiring.is_removed
        assert retiring not in pool.healthy("decode")
        retiring.num_in_flight = 0
        await pool.refresh()
        assert retiring not in pool.workers
        await pool.close()

    asyncio.run(scenario())


def test_a_dns_server_failing_is_a_failed_lookup_and_an_unknown_name_no_workers(monkeypatch):
    """EAI_AGAIN (the resolver timed out) says nothing about the workers; EAI_NONAME does."""
    errors = iter([socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
                   socket.gaierror(socket.EAI_NONAME, "Name or service not known")])

    async def failing_getaddrinfo(*args, **kwargs):
        raise next(errors)

    async def scenario():
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", failing_getaddrinfo)
        target = Target.parse("dns:///decode.tandem.svc:7001")
        with pytest.raises(LookupFailed, match="DNS lookup of decode.tandem.svc failed: "
                                               "Temporary failure"):
            await target.resolve()
        assert await target.resolve() == []

    asyncio.run(scenario())


def test_a_failed_lookup_keeps_the_last_answer_and_only_an_answer_retires(tmp_path, caplog):
    listing = tmp_path / "decode.txt"
    listing.write_text("127.0.0.1:1\n127.0.0.1:2\n")

    async def scenario():
        pool = WorkerPool(["127.0.0.1:9"], [f"file://{listing}"], [],
                          HealthPolicy(check_interval_seconds=60))
        await pool.refresh()
        decode = [w for w in pool.workers if w.role == "decode"]
        assert sorted(w.address for w in decode) == ["127.0.0.1:1", "127.0.0.1:2"]
        # The file goes missing (a script deleting it before writing a new one): twice, and
        # the warning says so once.
        os.rename(listing, tmp_path / "aside.txt")
        with caplog.at_level(logging.INFO, logger="tandem.router.worker_pool"):
            await pool.refresh()
            await pool.refresh()
        assert [w for w in pool.workers if w.role == "decode"] == decode
        assert not any(w.is_removed for w in decode)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings == [f"decode workers: cannot read {listing}: No such file or directory;"
                            " keeping its last answer, 2 worker(s)"]
        # An answer again: one line keeps that worker, then an empty file retires them all.
        listing.write_text("127.0.0.1:2\n")
        await pool.refresh()
        assert [w.address for w in pool.workers if w.role == "decode"] == ["127.0.0.1:2"]
        assert "decode target %s answers again: 1 worker(s)" % listing in caplog.text
        listing.write_text("")
        await pool.refresh()
        assert [w for w in pool.workers if w.role == "decode"] == []
        await pool.close()

    asyncio.run(scenario())


def test_a_target_that_never_answered_has_no_workers(tmp_path, caplog):
    async def scenario():
        pool = WorkerPool(["127.0.0.1:9"], [f"file://{tmp_path / 'not-yet'}"], [],
                          HealthPolicy(check_interval_seconds=60))
        with caplog.at_level(logging.WARNING, logger="tandem.router.worker_pool"):
            await pool.refresh()
        assert [w.role for w in pool.workers] == ["prefill"]
        assert "none known until it answers" in caplog.text
        await pool.close()

    asyncio.run(scenario())
