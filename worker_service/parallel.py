"""Tensor parallelism: the rank group, its collectives, and how rank 0 starts the others.

Design (after vLLM's linear layers, in a smaller form):
- qkv_proj and gate_up_proj are column-parallel: rank r holds its share of the KV heads
  with their q heads (whole GQA groups) and of the MLP's intermediate columns; o_proj and
  down_proj are row-parallel (the matching input slice) and their partial outputs are
  all-reduced. Shares need not be equal (LayerShard): the default model has 3 KV heads.
- The embedding and the LM head are replicated on every rank: Llama-family models often
  tie them, rank 0 then samples from full logits with no gather, and ranks 1..N-1 stay pure
  forward executors with no per-sampling collective. "Layer weights" (the decoder layers,
  most of the model) are what is split.
- Rank 0 is the worker the scheduler talks to. For each command (memory handshake, cache
  allocation, a step's prepared inputs, stop) it broadcasts a small pickled message over a
  CPU (gloo) group; every rank then does the same work with its own weights and KV pool.
- Ranks 1..N-1 are local processes started by rank 0 (`spawn_ranks`), or processes started
  by hand elsewhere (`python -m worker_service --tp-rank R`) that join the same init method
  (`tcp://host:port`, or `env://` from MASTER_ADDR / MASTER_PORT). A rank whose parent or
  peer dies exits; rank 0 exits when a rank it started dies.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, fields, is_dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from services.config import ParallelConfig, WorkerConfig
from worker_service.models.config import ModelArchConfig

log = logging.getLogger(__name__)

STARTUP_TIMEOUT = timedelta(minutes=10)  # ranks joining; also bounds one collective
IDLE_TIMEOUT = timedelta(days=365)  # ranks 1..N-1 wait this long for rank 0's next command


class TPGroup:
    """One rank's view of the tensor-parallel group; the default (size 1) does nothing."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        device_group: Any = None,
        cpu_group: Any = None,
    ) -> None:
        self.rank, self.size = rank, size
        self.device_group, self.cpu_group = device_group, cpu_group
        self.children: list[subprocess.Popen[bytes]] = []
        self._stopping = False

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank that talks to the scheduler and sends the commands."""
        return self.rank == 0

    def local_device(self, device: torch.device) -> torch.device:
        """On CUDA each local rank takes its own GPU (rank modulo the GPUs visible)."""
        if self.size == 1 or device.type != "cuda":
            return device
        return torch.device("cuda", self.rank % torch.cuda.device_count())

    # ------------------------------------------------------------- collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (row-parallel layers); identity at size 1."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV memory handshake)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def command(self, *message: Any) -> None:
        """Rank 0: send `message` to the other ranks (no-op elsewhere and at size 1)."""
        if self.size > 1 and self.is_driver:
            dist.broadcast_object_list([message], src=0, group=self.cpu_group)

    def receive(self) -> tuple[Any, ...]:
        """Ranks 1..N-1: the next message rank 0 sends."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return tuple(box[0])

    def send_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> None:
        """Rank 0: a step's prepared model inputs, as host tensors, to the other ranks."""
        if self.size > 1 and self.is_driver:
            cpu = torch.device("cpu")
            self.command("step", input_ids.to(cpu), positions.to(cpu), tensors_to(meta, cpu))

    # ---------------------------------------------------------------- lifetime
    def stop(self) -> None:
        """Rank 0: tell the ranks to exit, wait for the ones it started; leave the group."""
        if self.size == 1 or self._stopping or not dist.is_initialized():
            return
        self._stopping = True
        if self.is_driver:
            try:
                self.command("stop")
            except RuntimeError as exc:  # a rank already gone
                log.warning("tensor parallel stop: %s", exc)
            for child in self.children:
                try:
                    child.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
        dist.destroy_process_group()


def tensors_to(obj: Any, device: torch.device) -> Any:
    """A dataclass with its tensor fields moved to `device` (others unchanged)."""
    if not is_dataclass(obj) or isinstance(obj, type):
        return obj
    moved = {
        f.name: getattr(obj, f.name).to(device)
        for f in fields(obj)
        if isinstance(getattr(obj, f.name), torch.Tensor)
    }
    return replace(obj, **moved)


@dataclass(frozen=True)
class LayerShard:
    """One rank's share of every decoder layer: whole GQA groups (KV heads with their q
    heads) and a range of MLP columns. Shares are as even as the model allows: KV heads
    as evenly as they divide, then MLP columns chosen so every rank holds about the same
    weight bytes (SmolLM2-135M's 3 KV heads over 2 ranks: 2 + 1 heads, 683 + 853 columns)."""

    kv_start: int
    kv_end: int
    group: int  # q heads per KV head
    mlp_start: int
    mlp_end: int

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def q_start(self) -> int:
        return self.kv_start * self.group

    @property
    def intermediate(self) -> int:
        return self.mlp_end - self.mlp_start


def check_splittable(cfg: ModelArchConfig, size: int) -> None:
    """ValueError unless every rank can get at least one KV head and one MLP column."""
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({cfg.num_heads}) is not a multiple of "
            f"num_key_value_heads ({cfg.num_kv_heads})"
        )
    if size > cfg.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} exceeds the model's num_key_value_heads "
            f"({cfg.num_kv_heads}): each rank needs at least one KV head"
        )


def layer_shard(cfg: ModelArchConfig, rank: int, size: int) -> LayerShard:
    """Rank `rank`'s LayerShard of `cfg` over `size` ranks (the same on every rank)."""
    check_splittable(cfg, size)
    group = cfg.num_heads // cfg.num_kv_heads
    kv = [cfg.num_kv_heads // size + (r < cfg.num_kv_heads % size) for r in range(size)]
    # weight elements: per KV head its q, k, v rows and o columns; per MLP column gate, up, down
    per_kv, per_col = (2 * group + 2) * cfg.head_dim * cfg.hidden_size, 3 * cfg.hidden_size
    target = (sum(kv) * per_kv + cfg.intermediate_size * per_col) / size
    mlp = [max(1, round((target - k * per_kv) / per_col)) for k in kv]
    mlp[-1] += cfg.intermediate_size - sum(mlp)
    if min(mlp) < 1:
        raise ValueError(f"cannot balance {cfg.intermediate_size} MLP columns over {size} ranks")
    kv_start, mlp_start = sum(kv[:rank]), sum(mlp[:rank])
    return LayerShard(kv_start, kv_start + kv[rank], group, mlp_start, mlp_start + mlp[rank])


def resolve_init_method(configured: str) -> str:
    """The configured method; else env:// when MASTER_ADDR/PORT are set; else a free port."""
    if configured:
        return configured
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return "env://"
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def init_group(rank: int, size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the group: NCCL for tensors on CUDA (gloo on CPU), gloo for the commands."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=STARTUP_TIMEOUT
    )
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    device_group = dist.group.WORLD if backend == "nccl" else cpu_group
    log.info("tensor parallel rank %d of %d joined (%s, %s)", rank, size, backend, init_method)
    return TPGroup(rank, size, device_group, cpu_group)


def start_group(config: WorkerConfig, device: torch.device) -> TPGroup:
    """Rank 0's side: start ranks 1..N-1 (unless they run elsewhere) and join them."""
    par: ParallelConfig = config.parallel
    if par.tensor_parallel_size == 1:
        return TPGroup()
    from services.default_model import resolve_model
    from worker_service.models.config import read_model_config

    # fail here, before any rank starts, when the model cannot be split
    check_splittable(read_model_config(resolve_model(config.model.model)), par.tensor_parallel_size)
    method = resolve_init_method(par.init_method)
    children = [
        spawn_rank(config, rank, method)
        for rank in range(1, par.tensor_parallel_size)
        if par.spawn_ranks
    ]
    group = init_group(0, par.tensor_parallel_size, method, device)
    group.children = children
    atexit.register(group.stop)
    threading.Thread(target=_exit_when_a_rank_dies, args=(group,), daemon=True).start()
    return group


def spawn_rank(config: WorkerConfig, rank: int, init_method: str) -> subprocess.Popen[bytes]:
    """`python -m worker_service.tp_worker` for `rank`; the config goes through stdin."""
    argv = [sys.executable, "-m", "worker_service.tp_worker", "--rank", str(rank)]
    argv += ["--init-method", init_method, "--parent-pid", str(os.getpid())]
    argv += ["--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(config))
    proc.stdin.close()
    return proc


def _exit_when_a_rank_dies(group: TPGroup) -> None:
    """Rank 0: a rank it started died on its own -> the group is broken, so exit too."""
    while not group._stopping:
        for child in group.children:
            code = child.poll()
            if code is not None and not group._stopping:
                log.error("tensor parallel rank exited (code %s); stopping this worker", code)
                os._exit(1)
        time.sleep(0.5)


def exit_with_parent(parent_pid: int) -> None:
    """Ranks 1..N-1 started by rank 0: exit as soon as rank 0's process is gone."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
