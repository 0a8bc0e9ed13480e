"""EngineRouter over several engine replicas (data parallel): prefix affinity computed like
the scheduler's prefix cache, the load bound, n choices on one replica, failover, aborts,
aggregated stats and DNS discovery, against real gRPC fake engines on loopback."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from gateway import router as router_module
from gateway.errors import ApiError
from gateway.router import EngineRouter, RoutedStream, aggregate_stats
from gateway.routing import Candidate, RoutingPolicy, affinity_key, choose, resolve_replicas
from scheduler_service.prefix_cache import update_block_hashes
from scheduler_service.request import Request
from services.convert import to_proto
from services.grpc_utils import GrpcServer
from services.pb import engine_pb2
from services.step_types import SchedulerStats
from services.types import EngineCoreOutput, EngineCoreRequest, SamplingParams
from tests.gateway.fake_engine import FakeEngine, start_fake_engine

BLOCK = 16  # the fake engine's block size


class LoadedEngine(FakeEngine):
    """A fake engine whose figures (GetStats, and on its stream) report `waiting` queued
    requests."""

    waiting = 0

    def session_stats(self) -> SchedulerStats:
        return SchedulerStats(num_waiting=self.waiting, kv_cache_usage=0.1, healthy=True)

    async def GetStats(self, request: Any, context: Any) -> Any:
        return to_proto(self.session_stats(), engine_pb2.SchedulerStats)


def req(
    request_id: str, prompt: list[int], max_tokens: int = 3, salt: str = ""
) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id, prompt, SamplingParams(max_tokens=max_tokens), cache_salt=salt
    )


def prefixed(prefix: int, suffix: int, blocks: int = 6) -> list[int]:
    """A prompt of `blocks` full blocks: 4 blocks of prefix `prefix`, then a distinct tail."""
    return [1000 + prefix] * (4 * BLOCK) + [2000 + suffix] * ((blocks - 4) * BLOCK)


async def drain(stream: RoutedStream) -> list[EngineCoreOutput]:
    async with stream:
        return [out async for out in stream]


def run_with_engines(
    n: int, body: Callable[[list[FakeEngine], list[GrpcServer]], Awaitable[None]]
) -> None:
    """Serve `n` fake engines (each its own servicer) on loopback and run `body`."""

    async def main() -> None:
        engines: list[FakeEngine] = [LoadedEngine([5, 6, 7, 8]) for _ in range(n)]
        servers = [await start_fake_engine(e) for e in engines]
        try:
            await body(engines, servers)
        finally:
            for server in servers:
                await server.stop(0)

    asyncio.run(main())


def addresses(servers: list[GrpcServer]) -> list[str]:
    return [f"127.0.0.1:{s.port}" for s in servers]


async def wait_until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def counts(engines: list[FakeEngine]) -> list[int]:
    return [len(e.requests) for e in engines]


# -- pure policy --------------------------------------------------------------------------


def test_affinity_key_is_the_hash_the_scheduler_computes() -> None:
    prompt = list(range(100, 100 + 5 * BLOCK + 3))
    for salt in ("", "tenant-a"):
        sched = Request("r", prompt, SamplingParams(), 1024, cache_salt=salt)
        hashes = update_block_hashes(sched, BLOCK)
        assert affinity_key(req("r", prompt, salt=salt), BLOCK, 4) == hashes[3]
        assert affinity_key(req("r", prompt[: 2 * BLOCK], salt=salt), BLOCK, 4) == hashes[1]
    assert affinity_key(req("r", prompt[: BLOCK - 1]), BLOCK, 4) is None  # under one block
    assert affinity_key(req("r", prompt), BLOCK, 4) != affinity_key(
        req("r", prompt, salt="x"), BLOCK, 4
    )


def test_choose_keeps_affinity_within_the_load_bound() -> None:
    policy = RoutingPolicy(load_slack=2, load_factor=0.0)
    key = b"k" * 32
    idle = [Candidate("a:1", 0, 0.1), Candidate("b:1", 0, 0.1), Candidate("c:1", 0, 0.1)]
    winner = choose(idle, key, policy, 0)
    assert all(choose(idle, key, policy, t) == winner for t in range(5))  # stable
    busy = list(idle)
    busy[winner] = Candidate(busy[winner].address, 3, 0.1)  # over min (0) + slack (2)
    fallback = choose(busy, key, policy, 0)
    assert fallback != winner and busy[fallback].load == 0
    busy[winner] = Candidate(busy[winner].address, 2, 0.1)  # at the bound: affinity holds
    assert choose(busy, key, policy, 0) == winner
    full = list(idle)
    full[winner] = Candidate(full[winner].address, 0, 0.95)  # KV pool nearly full
    assert choose(full, key, policy, 0) != winner


def test_choose_without_a_key_takes_the_least_loaded_and_rotates_ties() -> None:
    policy = RoutingPolicy()
    loads = [Candidate("a:1", 4, 0.0), Candidate("b:1", 1, 0.0), Candidate("c:1", 1, 0.0)]
    assert {choose(loads, None, policy, t) for t in range(6)} == {1, 2}


def test_resolve_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_replicas("10.1.2.3:50051") == ["10.1.2.3:50051"]
    assert resolve_replicas("localhost:50051") == ["localhost:50051"]  # one address: the name

    def fake(host: str, port: int, **kw: Any) -> list[Any]:
        assert host == "engine"
        tcp = socket.SOCK_STREAM
        return [
            (socket.AF_INET, tcp, 6, "", ("10.0.0.2", port)),
            (socket.AF_INET, tcp, 6, "", ("10.0.0.1", port)),
            (socket.AF_INET6, tcp, 6, "", ("fd00::1", port, 0, 0)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    assert resolve_replicas("engine:50051") == ["10.0.0.1:50051", "10.0.0.2:50051"]
    with pytest.raises(ValueError):
        resolve_replicas("engine")


def test_aggregate_stats() -> None:
    a = SchedulerStats(num_running=2, num_blocks_total=100, num_blocks_used=50, num_finished=3,
                       prefix_cache_queries=10, prefix_cache_hits=4, healthy=False)  # fmt: skip
    b = SchedulerStats(num_running=1, num_waiting=5, num_blocks_total=300, num_blocks_used=50,
                       num_finished=4, prefix_cache_queries=10, prefix_cache_hits=6)  # fmt: skip
    total = aggregate_stats([a, b])
    assert (total.num_running, total.num_waiting, total.num_finished) == (3, 5, 7)
    assert total.kv_cache_usage == 0.25 and total.prefix_cache_hits == 10 and total.healthy


# -- live replicas ------------------------------------------------------------------------


def test_shared_prefixes_stay_together_and_distinct_prompts_spread() -> None:
    async def body(engines: list[FakeEngine], servers: list[GrpcServer]) -> None:
        router = EngineRouter(addresses(servers))
        await router.server_info()  # learns the block size, as the gateway does first
        for i in range(8):
            await drain(router.generate(req(f"shared{i}-0", prefixed(7, i))))
        assert sorted(counts(engines)) == [0, 8]
        for engine in engines:
            engine.requests.clear()
        for i in range(40):
            await drain(router.generate(req(f"distinct{i}-0", prefixed(100 + i, i))))
        assert min(counts(engines)) >= 10, counts(engines)
        await router.close()

    run_with_engines(2, body)


def test_round_robin_alternates() -> None:
    async def body(engines: list[FakeEngine], servers: list[GrpcServer]) -> None:
        router = EngineRouter(addresses(servers), RoutingPolicy("round-robin"))
        await router.server_info()
        for i in range(6):
            await drain(router.generate(req(f"rr{i}-0", prefixed(7, 0))))
        assert counts(engines) == [3, 3]
        await router.close()

    run_with_engines(2, body)


def test_a_loaded_replica_loses_its_affinity() -> None:
    async def body(engines: list[FakeEngine], servers: list[GrpcServer]) -> None:
        router = EngineRouter(addresses(servers))
        await router.server_info()
        for engine in engines:
            engine.waiting = 50  # type: ignore[attr-defined]
        await drain(router.generate(req("probe-0", prefixed(9, 0))))
        home = counts(engines).index(1)
        stats = router.replicas[home].fresh_stats(time.monotonic())  # from the probe's stream
        assert stats is not None and stats.num_waiting == 50
        assert router.replicas[1 - home].client.latest_stats is None  # it never streamed
        await drain(router.generate(req("moved-0", prefixed(9, 1))))
        assert engines[1 - home].requests[-1].request_id == "moved-0"
        await router.close()

    run_with_engines(2, body)


def test_the_choices_of_one_request_stay_on_one_replica() -> None:
    async def body(engines: list[FakeEngine], servers: list[GrpcServer]) -> None:
        router = EngineRouter(addresses(servers))
        await router.server_info()
        for job in range(6):  # short prompts: no affinity key, least loaded with rotating ties
            streams = [router.generate(req(f"job{job}-{i}", [1, 2, 3])) for i in range(4)]
            await asyncio.gather(*(drain(s) for s in streams))
            holders = {e_i for e_i, e in enumerate(engines)
                       for r in e.requests if r.request_id.startswith(f"job{job}-")}  # fmt: skip
            assert len(holders) == 1, (job, holders)
        assert min(counts(engines)) > 0  # different jobs did use both replicas
        await router.close()

    run_with_engines(2, body)


def test_failover_in_flight_requests_fail_fast_and_new_ones_move() -> None:
    async def body(engines: list[FakeEngine], servers: list[GrpcServer]) -> None:
        router = EngineRouter(addresses(servers))
        await router.server_info()
        for engine in engines:
            engine.token_delay_s = 0.05
        prompt = prefixed(11, 0)
        stream = router.generate(req("long-0", prompt, max_tokens=4))
        first = await anext(aiter(stream))
        assert first.new_token_ids == [5]
        home = counts(engines).index(1)
        await servers[home].stop(0)  # the replica dies mid-request
        t0 = time.monotonic()
        with pytest.raises(ApiError):
            async with stream:
                async for _ in stream:
                    pass
        assert time.monotonic() - t0 < 2.0
        outs = await drain(router.generate(req("after-0", prompt)))  # its key points home
        assert outs[-1].finished and engines[1 - home].requests[-1].request_id == "after-0"
        await router.close()

    run_with_engines(2, body)


def test_abort_goes_to_the_holder_or_everywhere() -> None:
    async def body(engines: list[FakeEngine], servers: list[GrpcServer]) -> None:
        router = EngineRouter(addresses(servers))
        await router.server_info()
        engines[0].token_delay_s = engines[1].token_delay_s = 0.2
        stream = router.generate(req("held-0", prefixed(3, 0), max_tokens=4))
        await anext(aiter(stream))
        assert await router.abort(["held-0"]) == 1
        assert sorted(e.aborted for e in engines) == [[], ["held-0"]]
        assert await router.abort(["nobody"]) == 2  # unknown: every replica is asked
        stream.cancel()
        stats = await router.stats()  # each fake reports 0 running, 0 waiting
        assert stats.num_blocks_total == 0 and stats.healthy
        assert await router.healthy()
        await router.close()

    run_with_engines(2, body)


@pytest.fixture
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[str]]]:
    answers: dict[str, list[str]] = {}
    monkeypatch.setattr(router_module, "resolve_replicas", lambda name: answers[name])
    yield answers


def test_one_dns_name_discovers_replicas(fake_dns: dict[str, list[str]]) -> None:
    async def body(engines: list[FakeEngine], servers: list[GrpcServer]) -> None:
        name = "engine.test:50051"
        fake_dns[name] = addresses(servers)
        router = EngineRouter([name], resolve_every_s=0.05)
        await wait_until(lambda: len(router.replicas) == 2)
        await router.server_info()
        for i in range(20):
            await drain(router.generate(req(f"dns{i}-0", prefixed(200 + i, i))))
        assert min(counts(engines)) > 0
        fake_dns[name] = addresses(servers)[:1]  # scaled down to one replica
        await wait_until(lambda: len(router.replicas) == 1)
        await drain(router.generate(req("last-0", prefixed(1, 1))))
        assert engines[0].requests[-1].request_id == "last-0"
        await router.close()

    run_with_engines(2, body)


def test_new_prefixes_spread_and_known_ones_go_home() -> None:
    policy = RoutingPolicy(prefix_slack=1)
    key = b"p" * 32
    idle = [Candidate("a:1", 0, 0.1), Candidate("b:1", 0, 0.1)]
    winner = choose(idle, key, policy, 0)
    crowded = list(idle)
    crowded[winner] = Candidate(idle[winner].address, 0, 0.1, prefixes=2)  # 2 > 0 + slack
    assert choose(crowded, key, policy, 0) == 1 - winner
    assert choose(crowded, key, policy, 0, home=winner) == winner  # seen before: its home

    async def body(engines: list[FakeEngine], servers: list[GrpcServer]) -> None:
        router = EngineRouter(addresses(servers))
        await router.server_info()
        home: dict[int, int] = {}
        for p in range(8):
            await drain(router.generate(req(f"first{p}-0", prefixed(300 + p, 0))))
            home[p] = next(i for i, e in enumerate(engines) if e.requests[-1:] and
                           e.requests[-1].request_id == f"first{p}-0")  # fmt: skip
        assert sorted(counts(engines)) in ([4, 4], [3, 5])
        for p in range(8):
            await drain(router.generate(req(f"again{p}-0", prefixed(300 + p, 1))))
            assert engines[home[p]].requests[-1].request_id == f"again{p}-0"
        await router.close()

    run_with_engines(2, body)


class SlowInfoEngine(LoadedEngine):
    """A fake engine whose GetServerInfo takes a while (a replica still connecting)."""

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        await asyncio.sleep(0.5)
        return await super().GetServerInfo(request, context)


def test_a_call_in_flight_survives_its_replica_leaving_dns(
    fake_dns: dict[str, list[str]],
) -> None:
    """Compose `--scale engine=2`: the gateway starts with the name `engine:50051`, asks it for
    GetServerInfo, and meanwhile DNS answers with two addresses, which retires the name's
    client; closing it under the call cancelled the call and crashed the gateway's start."""

    async def body(engines: list[FakeEngine], servers: list[GrpcServer]) -> None:
        slow = await start_fake_engine(SlowInfoEngine([5, 6, 7, 8]))
        try:
            name = f"localhost:{slow.port}"
            fake_dns[name] = addresses(servers)
            router = EngineRouter([name], resolve_every_s=0.05)
            info = await router.server_info()  # on the name's client, retired meanwhile
            assert info.block_size == BLOCK and len(router.replicas) == 2
            assert [r.address for r in router.replicas] == addresses(servers)
            await router.close()
        finally:
            await slow.stop(0)

    run_with_engines(2, body)
