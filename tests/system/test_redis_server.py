"""The suite's redis-server comes with the project's own install step, not with the machine."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from tests.support.redis_server import RedisServer


def test_a_real_redis_server_starts_on_a_machine_with_none_on_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no system redis-server to find
    server = RedisServer(tmp_path)
    server.start()
    try:
        assert asyncio.run(run_a_script(server.url)) == b"6"
    finally:
        server.stop()


async def run_a_script(url: str) -> bytes:
    """A Lua script, as the limiter runs one: the server is a real Redis, not a stand-in."""
    client = aioredis.from_url(url)
    try:
        return await client.eval("return tostring(tonumber(ARGV[1]) * 2)", 0, 3)
    finally:
        await client.aclose()
