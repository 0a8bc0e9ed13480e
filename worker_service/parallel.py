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
  allocation, a step's prepared inputs, stop) it broadcasts a typed int64 header, and for a
  step one uint8 payload of tensors with a JSON description (worker_service.tp_messages),
  over a CPU (gloo) group; no Python objects cross ranks. Every rank then does the same work with
  its own weights and KV pool.
- Ranks 1..N-1 are local processes started by rank 0 (`spawn_ranks`: they meet through a
  private file, and gloo/NCCL sockets stay on loopback), or processes started by hand
  elsewhere (`python -m worker_service --tp-rank R --tp-init-method tcp://HOST:PORT`, or
  MASTER_ADDR / MASTER_PORT) that meet at rank 0's authenticated store on HOST:PORT
  (worker_service.rendezvous; the internal token is required). A rank whose parent or
  peer dies exits; rank 0 exits when a rank it started dies.

Multi-host threat model: the rendezvous needs the token, but gloo's (and NCCL's) data
sockets, on ports the OS picks on every rank, carry no authentication. Firewall them so
that only the TP hosts reach each other; a peer that gets in can at worst send wrong
numbers or stall the group (nothing it sends is evaluated).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from services.config import ParallelConfig, SecurityConfig, WorkerConfig
from services.log import current_log_format
from worker_service import rendezvous, tp_messages
from worker_service.models.config import ModelArchConfig
from worker_service.tp_messages import HEADER_LEN, Command

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
        self.on_stop: list[Callable[[], None]] = []  # run once the group is left
        self._stopping = False
        self.expert_parallel = False  # MoE experts split by id, not by columns (ModelRunner)

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

    def command(self, name: str, *args: int) -> None:
        """Rank 0: send "memory", "cache" (with the number of KV blocks) or "stop" to the
        other ranks (no-op elsewhere and at size 1); steps go through send_step."""
        if self.size > 1 and self.is_driver:
            command = Command[name.upper()]
            if command == Command.STEP:
                raise ValueError("a step goes through send_step")
            self._send_header(tp_messages.header(command, *args))

    def receive(self) -> tuple[Any, ...]:
        """Ranks 1..N-1: the next command of rank 0: ("memory",), ("cache", num_blocks),
        ("stop",) or ("step", input_ids, positions, meta); ProtocolError for anything else."""
        h = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.broadcast(h, src=0, group=self.cpu_group)
        command, a, b = tp_messages.read_header(h)
        if command == Command.CACHE:
            return ("cache", a)
        if command == Command.STEP:
            payload = torch.empty(b, dtype=torch.uint8)
            dist.broadcast(payload, src=0, group=self.cpu_group)
            return ("step", *tp_messages.decode_step(payload, a))
        return (command.name.lower(),)

    def send_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> None:
        """Rank 0: a step's prepared model inputs, as host tensors, to the other ranks."""
        if self.size > 1 and self.is_driver:
            text_len, payload = tp_messages.encode_step(input_ids, positions, meta)
            self._send_header(tp_messages.header(Command.STEP, text_len, payload.numel()))
            dist.broadcast(payload, src=0, group=self.cpu_group)

    def _send_header(self, h: torch.Tensor) -> None:
        tp_messages.read_header(h)  # the check receivers make, before anything is sent
        dist.broadcast(h, src=0, group=self.cpu_group)

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
        for release in self.on_stop:
            release()


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


# ------------------------------------------------------------------ rendezvous
@dataclass(frozen=True)
class LocalRendezvous:
    """Ranks on this host started by rank 0: a FileStore at `path`, in a 0700 directory
    that rank 0 made and removes once the group is formed."""

    path: str


@dataclass(frozen=True)
class RemoteRendezvous:
    """Ranks started by hand: rank 0 serves an authenticated store at `init_method`
    (tcp://HOST:PORT) and every rank needs `security`'s token."""

    init_method: str
    security: SecurityConfig


Rendezvous = LocalRendezvous | RemoteRendezvous


def resolve_init_method(configured: str) -> str:
    """Where ranks started by hand meet: the configured tcp://HOST:PORT, else the one
    MASTER_ADDR / MASTER_PORT name (ValueError when there is neither)."""
    if not configured:
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not (host and port):
            raise ValueError("ranks started by hand need --tp-init-method or MASTER_ADDR/PORT")
        configured = f"tcp://{f'[{host}]' if ':' in host else host}:{port}"
    rendezvous.store_address(configured)  # ValueError unless tcp://HOST:PORT
    return configured


def _open_store(rank: int, size: int, how: Rendezvous) -> tuple[Any, Callable[[], None]]:
    """This rank's store, and what to call once no rank needs it any more."""
    if isinstance(how, LocalRendezvous):
        rendezvous.hold_to_loopback(os.environ)
        directory = Path(how.path).parent

        def remove() -> None:
            if rank == 0:
                shutil.rmtree(directory, ignore_errors=True)

        return dist.FileStore(how.path, size), remove
    address = rendezvous.store_address(how.init_method)
    server = rendezvous.StoreServer(address, how.security, size) if rank == 0 else None
    client = rendezvous.RemoteStore(address, how.security, STARTUP_TIMEOUT)

    def close() -> None:
        client.close()
        if server is not None:
            server.stop()

    return client, close


def init_group(rank: int, size: int, how: Rendezvous, device: torch.device) -> TPGroup:
    """Join the group: NCCL for tensors on CUDA (gloo on CPU), gloo for the commands.
    With gloo the store is released as soon as every rank has joined (gloo never reads it
    again); NCCL forms communicators lazily and its watchdog polls the store, so there it
    lasts until stop()."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store, release = _open_store(rank, size, how)
    try:
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=size, timeout=STARTUP_TIMEOUT
        )
        cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        device_group = dist.group.WORLD if backend == "nccl" else cpu_group
        group = TPGroup(rank, size, device_group, cpu_group)
        group.min_over_ranks(0)  # a barrier: every rank is past the rendezvous
    except BaseException:
        release()
        raise
    if backend == "gloo":
        release()
    else:
        group.on_stop.append(release)
    kind = "local" if isinstance(how, LocalRendezvous) else how.init_method
    log.info("tensor parallel rank %d of %d joined (%s, %s)", rank, size, backend, kind)
    return group


def start_group(config: WorkerConfig, device: torch.device) -> TPGroup:
    """Rank 0's side: start ranks 1..N-1 (unless they run elsewhere) and join them."""
    par: ParallelConfig = config.parallel
    if par.tensor_parallel_size == 1:
        return TPGroup()
    from services.default_model import resolve_model
    from worker_service.models.config import read_model_config

    # fail here, before any rank starts, when the model cannot be split
    check_splittable(
        read_model_config(resolve_model(config.model.model, config.model.hub)),
        par.tensor_parallel_size,
    )
    how = _rank0_rendezvous(par)
    children = [
        spawn_rank(config, rank, how.path)
        for rank in range(1, par.tensor_parallel_size)
        if isinstance(how, LocalRendezvous)
    ]
    group = init_group(0, par.tensor_parallel_size, how, device)
    group.children = children
    atexit.register(group.stop)
    threading.Thread(target=_exit_when_a_rank_dies, args=(group,), daemon=True).start()
    return group


def _rank0_rendezvous(par: ParallelConfig) -> Rendezvous:
    """A private file for the ranks rank 0 starts; its token-guarded store otherwise."""
    if par.spawn_ranks:
        if par.init_method:
            raise ValueError(
                "--tp-init-method is for ranks started by hand (with --tp-no-spawn); "
                "the ranks rank 0 starts meet through a private file"
            )
        return LocalRendezvous(str(Path(tempfile.mkdtemp(prefix="tessera-tp-")) / "store"))
    return remote_rendezvous(par.init_method)


def remote_rendezvous(init_method: str) -> RemoteRendezvous:
    """The rendezvous of ranks started by hand, on any rank: rank 0's store at the resolved
    init method, behind the internal token (ValueError without one)."""
    from services.grpc_utils import internal_security

    security = internal_security()
    rendezvous.require_token(security)
    return RemoteRendezvous(resolve_init_method(init_method), security)


def spawn_rank(config: WorkerConfig, rank: int, store_path: str) -> subprocess.Popen[bytes]:
    """`python -m worker_service.tp_worker` for `rank`; the config goes through stdin as
    JSON, the rendezvous file (in rank 0's 0700 directory) on the command line."""
    argv = [sys.executable, "-m", "worker_service.tp_worker", "--rank", str(rank)]
    argv += ["--rendezvous-file", store_path, "--parent-pid", str(os.getpid())]
    argv += ["--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())]
    argv += ["--log-format", current_log_format()]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(tp_messages.encode_config(config))
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
