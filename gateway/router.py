"""`EngineRouter`: the gateway's engine client over several engine replicas (data parallel).

An engine replica is one scheduler with its worker(s). The router presents the
interface of `EngineClient` (generate, abort, server_info, stats, healthy,
close) over one `EngineClient` per replica, so the rest of the gateway does
not know how many there are. Replicas come from `--scheduler` given several
times, or from one DNS name re-resolved every `RESOLVE_EVERY_S` (compose
`--scale`, a Kubernetes headless Service).

Each request goes where its prompt's prefix hash went before, a new prefix to its
rendezvous winner unless that replica holds clearly more prefixes than another
(so a prefix lands where it is cached, and prefixes spread evenly), unless that
replica is over the load bound
(gateway/routing.py); load comes from the scheduler figures each replica's output
stream carries (`EngineClient.latest_stats`, no older than `STATS_MAX_AGE_S`) and the
router's own in-flight counts. Replicas whose figures say unhealthy, or whose calls
failed as unavailable, are skipped until their health check answers SERVING again. The choices of one client request (`{id}-{index}`) stay on
one replica. A request that fails as unavailable before any output is retried on
another replica; once output flowed, the error reaches the client (EngineClient
ends the stream with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from gateway.engine_client import RPC_TIMEOUT_S, EngineClient, EngineStream
from gateway.errors import ApiError, ServiceUnavailable
from gateway.routing import Candidate, RoutingPolicy, affinity_key, choose, resolve_replicas
from services.iteration_tokens import add_counts
from services.step_types import SchedulerStats, ServerInfo
from services.types import EngineCoreOutput, EngineCoreRequest

log = logging.getLogger(__name__)
HEALTH_EVERY_S = 0.5  # health checks of replicas marked down (only when there are several)
STATS_MAX_AGE_S = 1.0  # older stats do not count as load
RESOLVE_EVERY_S = 5.0  # DNS re-resolution of a single scheduler name
AGGREGATE_TIMEOUT_S = 0.8  # per replica in stats(), under the /metrics deadline of 1 s
MAX_KNOWN_PREFIXES = 65536  # affinity keys remembered (least recently routed forgotten first)


@dataclass(eq=False)
class Replica:
    """One engine replica and what the router knows of it."""

    address: str
    client: EngineClient
    healthy: bool = True  # until its figures or a failure say otherwise
    in_flight: int = 0  # this gateway's requests on it
    routed: int = 0  # requests sent to it since start
    groups: dict[str, int] = field(default_factory=dict)  # client request id -> choices open
    retired_at: float = 0.0  # monotonic time it left DNS (0: still known)

    def fresh_stats(self, now: float) -> SchedulerStats | None:
        """The figures its stream last carried, if no older than STATS_MAX_AGE_S."""
        stats = self.client.latest_stats
        return stats if stats and now - self.client.latest_stats_at <= STATS_MAX_AGE_S else None

    def candidate(self, now: float, prefixes: int) -> Candidate:
        stats = self.fresh_stats(now)
        queued = stats.num_waiting + stats.num_running if stats else 0
        kv = stats.kv_cache_usage if stats else 0.0
        return Candidate(self.address, max(queued, self.in_flight), kv, prefixes)


def group_of(request_id: str) -> str:
    """The client request a choice belongs to: serving.py names choices `{id}-{index}`."""
    head, sep, tail = request_id.rpartition("-")
    return head if sep and tail.isdigit() else request_id


class EngineRouter:
    """Routes requests over engine replicas; the same interface as `EngineClient`."""

    def __init__(
        self,
        targets: Sequence[str],
        policy: RoutingPolicy | None = None,
        resolve_every_s: float = RESOLVE_EVERY_S,
    ) -> None:
        if not targets:
            raise ValueError("at least one scheduler address is needed")
        self.policy = policy or RoutingPolicy()
        self._dns_name = targets[0] if len(targets) == 1 else None
        self._resolve_every_s = resolve_every_s
        self.replicas: list[Replica] = [Replica(t, EngineClient(t)) for t in dict.fromkeys(targets)]
        self._retired: list[Replica] = []  # gone from DNS; closed once idle
        self._holders: dict[str, Replica] = {}  # engine request id -> its replica
        self._block_size = 0  # from GetServerInfo
        self._prefixes = PrefixTable(MAX_KNOWN_PREFIXES)
        self._turn = 0
        self._tasks = [asyncio.get_running_loop().create_task(self._check_health_forever())]
        if self._dns_name is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._resolve_forever()))

    # -- the EngineClient interface --------------------------------------------------------

    def generate(self, request: EngineCoreRequest) -> RoutedStream:
        """Submit `request` to the replica chosen for it; iterate until an update is finished."""
        return RoutedStream(self, request, self._route(request, ()))

    async def abort(self, request_ids: Sequence[str]) -> int:
        """Abort by id on the replicas that hold them (all replicas for unknown ids)."""
        targets: dict[Replica, list[str]] = {}
        for request_id in request_ids:
            holder = self._holders.get(request_id)
            for replica in [holder] if holder else self.replicas:
                targets.setdefault(replica, []).append(request_id)
        if len(targets) == 1:
            ((replica, ids),) = targets.items()
            return await replica.client.abort(ids)
        found = await asyncio.gather(
            *(r.client.abort(ids) for r, ids in targets.items()), return_exceptions=True
        )
        return sum(n for n in found if isinstance(n, int))

    async def server_info(self) -> ServerInfo:
        """The first answer of a replica, healthy ones first."""
        error: ApiError = ServiceUnavailable("no engine replica is known")
        for replica in sorted(self.replicas, key=lambda r: not r.healthy):
            try:
                info = await replica.client.server_info()
            except ApiError as exc:
                error = exc
                continue
            self._block_size = info.block_size
            return info
        raise error

    async def stats(self) -> SchedulerStats:
        """Figures summed over replicas (KV usage over all their blocks)."""
        if len(self.replicas) == 1:
            return await self.replicas[0].client.stats()
        answers = [a for _, a in await self._gather_stats()]
        stats = [a for a in answers if isinstance(a, SchedulerStats)]
        if not stats:
            error = next(a for a in answers if isinstance(a, BaseException))
            raise error
        return aggregate_stats(stats)

    async def replica_stats(self) -> list[tuple[str, SchedulerStats | None]]:
        """(address, figures) of every replica; None for one that failed or did not answer
        within AGGREGATE_TIMEOUT_S."""
        return [
            (address, a if isinstance(a, SchedulerStats) else None)
            for address, a in await self._gather_stats()
        ]

    async def _gather_stats(self) -> list[tuple[str, SchedulerStats | BaseException]]:
        replicas = list(self.replicas)
        answers = await asyncio.gather(
            *(asyncio.wait_for(r.client.stats(), AGGREGATE_TIMEOUT_S) for r in replicas),
            return_exceptions=True,
        )  # a replica that hangs leaves the sum instead of holding up /metrics
        return [(r.address, a) for r, a in zip(replicas, answers, strict=True)]

    async def healthy(self) -> bool:
        """True while at least one replica reports SERVING."""
        answers = await asyncio.gather(*(r.client.healthy() for r in self.replicas))
        return any(answers)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for replica in [*self.replicas, *self._retired]:
            await replica.client.close()

    # -- routing ---------------------------------------------------------------------------

    def _route(self, request: EngineCoreRequest, exclude: Sequence[Replica]) -> Replica:
        """The replica for `request`: its group's, else the policy's choice among the healthy."""
        group = group_of(request.request_id)
        for replica in self.replicas:
            if group in replica.groups and replica not in exclude:
                return replica
        pool = [r for r in self.replicas if r not in exclude] or list(self.replicas)
        pool = [r for r in pool if r.healthy] or pool
        self._turn += 1
        if len(pool) == 1:
            return pool[0]
        if self.policy.mode == "round-robin":
            return pool[self._turn % len(pool)]
        key = affinity_key(request, self._block_size, self.policy.prefix_blocks)
        now = time.monotonic()
        candidates = [r.candidate(now, self._prefixes.count(r.address)) for r in pool]
        home_address = self._prefixes.home(key)
        homes = [i for i, r in enumerate(pool) if r.address == home_address]
        index = choose(candidates, key, self.policy, self._turn, homes[0] if homes else None)
        if key is not None:
            self._prefixes.assign(key, pool[index].address)
        return pool[index]

    def _attach(self, replica: Replica, request_id: str) -> None:
        group = group_of(request_id)
        replica.groups[group] = replica.groups.get(group, 0) + 1
        replica.in_flight += 1
        replica.routed += 1
        self._holders[request_id] = replica

    def _detach(self, replica: Replica, request_id: str) -> None:
        group = group_of(request_id)
        left = replica.groups.get(group, 0) - 1
        if left > 0:
            replica.groups[group] = left
        else:
            replica.groups.pop(group, None)
        replica.in_flight -= 1
        if self._holders.get(request_id) is replica:
            del self._holders[request_id]

    def _mark_down(self, replica: Replica) -> None:
        if replica.healthy and len(self.replicas) > 1:
            log.warning("engine replica %s is unavailable; routing around it", replica.address)
        replica.healthy = False

    # -- background: health of replicas marked down, and DNS ---------------------------------

    async def _check_health_forever(self) -> None:
        while True:
            if len(self.replicas) > 1:
                await asyncio.gather(*(self._check_health(r) for r in self.replicas))
            await asyncio.sleep(HEALTH_EVERY_S)

    async def _check_health(self, replica: Replica) -> None:
        """Figures on its stream that say unhealthy mark it down; a health check that says
        SERVING brings a replica marked down back."""
        stats = replica.fresh_stats(time.monotonic())
        if stats is not None and not stats.healthy:
            self._mark_down(replica)
        elif not replica.healthy and await replica.client.healthy():
            log.info("engine replica %s is serving again", replica.address)
            replica.healthy = True
        if not self._block_size:
            with contextlib.suppress(ApiError):
                self._block_size = (await replica.client.server_info()).block_size

    async def _resolve_forever(self) -> None:
        assert self._dns_name is not None
        while True:
            try:
                addresses = await asyncio.to_thread(resolve_replicas, self._dns_name)
            except (OSError, ValueError) as exc:
                log.warning(
                    "cannot resolve %s: %s; keeping the known replicas", self._dns_name, exc
                )
            else:
                self._set_replicas(addresses)
            await self._close_idle_retired()
            await asyncio.sleep(self._resolve_every_s)

    def _set_replicas(self, addresses: Sequence[str]) -> None:
        known = {r.address: r for r in self.replicas}
        if list(known) == list(addresses):
            return
        log.info("engine replicas: %s", ", ".join(addresses))
        self.replicas = [known.get(a) or Replica(a, EngineClient(a)) for a in addresses]
        kept = set(addresses)
        gone = [r for a, r in known.items() if a not in kept]
        for replica in gone:
            replica.retired_at = time.monotonic()
        self._retired.extend(gone)

    async def _close_idle_retired(self) -> None:
        """Close replicas gone from DNS once idle and past the unary deadline: closing the
        channel would cancel a call still on it (the first GetServerInfo, a stats poll)."""
        now = time.monotonic()
        done = [r for r in self._retired if not r.in_flight and now - r.retired_at > RPC_TIMEOUT_S]
        self._retired = [r for r in self._retired if r not in done]
        for replica in done:
            await replica.client.close()


class PrefixTable:
    """Which replica each recent affinity key went to, and how many keys each replica holds:
    a prefix seen before goes back to its replica, a new one to a replica holding few."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._homes: OrderedDict[bytes, str] = OrderedDict()
        self._counts: Counter[str] = Counter()

    def home(self, key: bytes | None) -> str | None:
        return None if key is None else self._homes.get(key)

    def count(self, address: str) -> int:
        return self._counts[address]

    def assign(self, key: bytes, address: str) -> None:
        old = self._homes.pop(key, None)
        if old is not None:
            self._counts[old] -= 1
        self._homes[key] = address
        self._counts[address] += 1
        if len(self._homes) > self._capacity:
            _, evicted = self._homes.popitem(last=False)
            self._counts[evicted] -= 1


def aggregate_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """One SchedulerStats for several replicas: counts summed, KV usage over all blocks,
    medians as the worst replica's, healthy when any is."""
    total = sum(s.num_blocks_total for s in stats)
    used = sum(s.num_blocks_used for s in stats)
    return SchedulerStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        num_blocks_total=total,
        num_blocks_used=used,
        kv_cache_usage=used / total if total else 0.0,
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_steps=sum(s.num_steps for s in stats),
        step_time_p50=max(s.step_time_p50 for s in stats),
        queue_time_p50=max(s.queue_time_p50 for s in stats),
        num_finished=sum(s.num_finished for s in stats),
        healthy=any(s.healthy for s in stats),
        spec_decode_num_drafts=sum(s.spec_decode_num_drafts for s in stats),
        spec_decode_num_draft_tokens=sum(s.spec_decode_num_draft_tokens for s in stats),
        spec_decode_num_accepted_tokens=sum(s.spec_decode_num_accepted_tokens for s in stats),
        iteration_tokens_bucket_counts=add_counts(
            [s.iteration_tokens_bucket_counts for s in stats]
        ),
        iteration_tokens_sum=sum(s.iteration_tokens_sum for s in stats),
    )


class RoutedStream:
    """An `EngineStream` that may move to another replica while it has produced nothing."""

    def __init__(self, router: EngineRouter, request: EngineCoreRequest, replica: Replica) -> None:
        self._router = router
        self._request = request
        self.request_id = request.request_id
        self._tried: list[Replica] = []
        self._produced = False  # output reached the caller: no retry elsewhere
        self._replica = replica
        self._stream = self._submit(replica)

    @property
    def done(self) -> bool:
        return self._stream.done

    @property
    def replica(self) -> str:
        """Address of the replica serving the request now."""
        return self._replica.address

    def _submit(self, replica: Replica) -> EngineStream:
        self._replica = replica
        self._tried.append(replica)
        self._router._attach(replica, self.request_id)
        self._attached = True
        return replica.client.generate(self._request)

    def _release(self) -> None:
        if self._attached:
            self._attached = False
            self._router._detach(self._replica, self.request_id)

    def cancel(self) -> None:
        """Abort the request in its scheduler; no-op once it is done."""
        self._stream.cancel()
        self._release()

    async def __aenter__(self) -> RoutedStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()

    async def __aiter__(self) -> AsyncIterator[EngineCoreOutput]:
        while True:
            try:
                async for out in self._stream:
                    self._produced = True
                    yield out
                self._release()
                return
            except ServiceUnavailable:
                self._release()
                if self._produced or not self._retry():
                    raise

    def _retry(self) -> bool:
        """Resubmit to another replica after an unavailable one; False when none is left."""
        router = self._router
        router._mark_down(self._replica)
        untried = [r for r in router.replicas if r not in self._tried]
        if not untried:
            return False
        replica = router._route(self._request, [r for r in router.replicas if r not in untried])
        log.info("request %s: retrying on %s", self.request_id, replica.address)
        self._stream = self._submit(replica)
        return True
