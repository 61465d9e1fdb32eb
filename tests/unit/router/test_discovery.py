"""Worker targets: static addresses, DNS names re-resolved, and files."""
from __future__ import annotations

import asyncio

import pytest

from tandem.router.discovery import Target
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
    assert asyncio.run(Target.parse(f"file://{tmp_path / 'missing'}").resolve()) == []
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
