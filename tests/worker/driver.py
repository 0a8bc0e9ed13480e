"""A small test scheduler that drives a worker the way scheduler_service does.

It owns the block pool and decides each step: FCFS, a per-step token budget
(chunked prefill when a prompt does not fit), a hash-chained prefix cache that
shares full computed blocks between requests (num_computed_tokens > 0 on
admission), and preemption by recompute when blocks run out (the victim is
dropped and re-sent later with its output tokens and a fresh block table).
Greedy, never stops at EOS: each request runs to `max_new_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.step_types import NewRequestData, SchedulerOutput
from services.types import SamplingParams
from services.worker_api import WorkerProtocol


@dataclass
class DriverRequest:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_step: int = 0
    outputs: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False  # the worker holds its state
    preempted: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


@dataclass
class DriverStats:
    steps: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    chunked_steps: int = 0  # steps where some request computed a partial prefill


class MiniScheduler:
    """Runs requests to completion against `worker`; `run()` returns outputs by request id."""

    def __init__(
        self,
        worker: WorkerProtocol,
        num_blocks: int,
        block_size: int,
        token_budget: int,
        max_new_tokens: int,
        prefix_caching: bool = False,
    ) -> None:
        self.worker, self.block_size, self.budget = worker, block_size, token_budget
        self.max_new_tokens, self.prefix_caching = max_new_tokens, prefix_caching
        self.free = list(range(num_blocks - 1, -1, -1))
        self.refs: dict[int, int] = {}
        self.cache: dict[int, int] = {}  # prefix hash -> block id
        self.block_hash: dict[int, int] = {}
        self.waiting: list[DriverRequest] = []
        self.running: list[DriverRequest] = []
        self.dropped: list[str] = []  # finished/preempted ids for the next step
        self.stats = DriverStats()
        worker.initialize_cache(num_blocks)

    def add(self, req: DriverRequest) -> None:
        self.waiting.append(req)

    def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        done: dict[str, list[int]] = {}
        while (self.waiting or self.running) and self.stats.steps < max_steps:
            so, scheduled = self._schedule()
            out = self.worker.execute_model(so)
            assert not out.request_errors, out.request_errors
            self._update(scheduled, out.sampled_by_request(), done)
        self.worker.execute_model(
            SchedulerOutput(self.stats.steps + 1, finished_req_ids=self.dropped)
        )
        return done

    # ----------------------------------------------------------- scheduling
    def _schedule(self) -> tuple[SchedulerOutput, list[tuple[DriverRequest, int]]]:
        self.stats.steps += 1
        so = SchedulerOutput(step_id=self.stats.steps, finished_req_ids=self.dropped)
        self.dropped = []
        budget, scheduled = self.budget, []
        for req in list(self.running):
            if budget == 0 or req not in self.running:
                continue
            n = min(len(req.tokens) - req.num_computed, budget)
            new_blocks = self._grow(req, req.num_computed + n, so)
            if new_blocks is None:
                continue  # req itself was preempted
            so.scheduled_cached_reqs.add(req.req_id, req.num_computed, new_blocks)
            scheduled.append((req, n))
            budget -= n
        while budget and self.waiting and self.waiting[0].arrival_step <= self.stats.steps:
            n = self._admit(self.waiting[0], budget, so)
            if n == 0:
                break
            scheduled.append((self.running[-1], n))
            budget -= n
        so.num_scheduled_tokens = {r.req_id: n for r, n in scheduled}
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        return so, scheduled

    def _admit(self, req: DriverRequest, budget: int, so: SchedulerOutput) -> int:
        hits = self._prefix_hits(req)
        n = min(len(req.tokens) - len(hits) * self.block_size, budget)
        needed = -(-(len(hits) * self.block_size + n) // self.block_size) - len(hits)
        revived = [b for b in hits if self.refs.get(b, 0) == 0]  # cached blocks on the free list
        if needed + len(revived) > len(self.free):
            return 0
        for b in hits:
            if b in revived:
                self.free.remove(b)
            self.refs[b] = self.refs.get(b, 0) + 1
        req.block_ids = hits + [self._take() for _ in range(needed)]
        req.num_computed = len(hits) * self.block_size
        self.stats.prefix_hit_tokens += req.num_computed
        so.scheduled_new_reqs.append(
            NewRequestData(
                req.req_id,
                req.prompt,
                list(req.outputs),
                req.params,
                list(req.block_ids),
                req.num_computed,
                resumed_from_preemption=req.preempted,
            )
        )
        self.waiting.pop(0)
        self.running.append(req)
        req.sent = True
        return n

    def _grow(self, req: DriverRequest, end: int, so: SchedulerOutput) -> list[int] | None:
        """Blocks so `req` can hold `end` tokens, preempting from the tail; None if req itself was."""
        needed = -(-end // self.block_size) - len(req.block_ids)
        while needed > len(self.free):
            victim = self.running[-1]
            self._preempt(victim, so)
            if victim is req:
                return None
        new = [self._take() for _ in range(max(needed, 0))]
        req.block_ids += new
        return new

    def _preempt(self, req: DriverRequest, so: SchedulerOutput) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed, req.preempted = 0, True
        self.waiting.insert(0, req)
        so.preempted_req_ids.append(req.req_id)
        self.stats.preemptions += 1

    # --------------------------------------------------------------- blocks
    def _take(self) -> int:
        block = self.free.pop()
        self.refs[block] = 1
        old = self.block_hash.pop(block, None)
        if old is not None:
            self.cache.pop(old, None)
        return block

    def _release(self, req: DriverRequest) -> None:
        for b in req.block_ids:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)  # stays in the prefix cache until reused
        req.block_ids = []

    def _prefix_hits(self, req: DriverRequest) -> list[int]:
        if not self.prefix_caching:
            return []
        hits: list[int] = []
        max_blocks = (len(req.tokens) - 1) // self.block_size  # compute at least one token
        for h in self._hashes(req.tokens)[:max_blocks]:
            block = self.cache.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _hashes(self, tokens: list[int]) -> list[int]:
        out, h = [], 0
        for j in range(len(tokens) // self.block_size):
            h = hash((h, tuple(tokens[j * self.block_size : (j + 1) * self.block_size])))
            out.append(h)
        return out

    def _register(self, req: DriverRequest) -> None:
        full = req.num_computed // self.block_size
        for j, h in enumerate(self._hashes(req.tokens)[:full]):
            if h not in self.cache:
                self.cache[h] = req.block_ids[j]
                self.block_hash[req.block_ids[j]] = h

    # --------------------------------------------------------------- update
    def _update(
        self, scheduled: list[tuple[DriverRequest, int]], sampled: dict, done: dict
    ) -> None:
        for req, n in scheduled:
            req.num_computed += n
            tokens = sampled[req.req_id]
            if req.num_computed < len(req.tokens):
                assert not tokens, "sampled inside a prefill"
                self.stats.chunked_steps += 1
            else:
                assert len(tokens) == 1
                req.outputs += tokens
            if self.prefix_caching:
                self._register(req)
            if len(req.outputs) >= self.max_new_tokens:
                self.running.remove(req)
                self._release(req)
                self.dropped.append(req.req_id)
                done[req.req_id] = req.outputs
