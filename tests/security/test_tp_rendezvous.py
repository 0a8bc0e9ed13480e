"""Issue 25 finding 1: the tensor-parallel rendezvous.

- `tessera serve --tensor-parallel-size 2`: no process of the stack listens on (or talks to)
  a non-loopback address, and the local ranks' rendezvous file is gone once they formed.
- Multi-host ranks: rank 0's store needs the internal token (wrong or none: UNAUTHENTICATED,
  nothing read or written; a rogue rank cannot join), holds at most MAX_STORE_BYTES, speaks
  TLS where configured, and closes once the group has formed; ranks without a token refuse
  to start.
- No Python objects cross ranks: nothing in worker_service serializes them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
import torch.distributed as dist

from benchmarks.stack import REPO, beyond_loopback, start_stack, tree_sockets
from services.config import SecurityConfig
from services.grpc_utils import sync_channel
from services.pb import rendezvous_pb2 as pb
from services.pb import rendezvous_pb2_grpc as pb_grpc
from services.security import TOKEN_ENV
from tests.conftest import free_port
from tests.security.test_internal_auth import pki  # noqa: F401 (a fixture)
from worker_service.rendezvous import MAX_STORE_BYTES, RemoteStore, StoreServer

pytestmark = pytest.mark.timeout(300)
TOKEN = "tp-rendezvous-token"
RIGHT, WRONG, NONE = SecurityConfig(token=TOKEN), SecurityConfig(token="guess"), SecurityConfig()


# ----------------------------------------------------------------- local ranks
@pytest.mark.slow
def test_serve_tp2_listens_and_talks_on_loopback_only() -> None:
    stack = start_stack("--tensor-parallel-size", "2", "--kv-cache-memory", "512MiB")
    try:
        reply = httpx.post(
            f"{stack.base_url}/v1/completions",
            json={
                "model": "SmolLM2-135M-Instruct",
                "prompt": "Hello",
                "max_tokens": 4,
                "temperature": 0,
            },
            timeout=120,
        )
        sockets = tree_sockets(stack.process.pid)
        tree = psutil.Process(stack.process.pid).children(recursive=True)
        ranks = [p.cmdline() for p in tree if "worker_service.tp_worker" in p.cmdline()]
    finally:
        assert stack.stop() == 0, stack.output()[-3000:]
    assert reply.status_code == 200, reply.text
    for name, local, remote in sockets:
        print(f"{name:45} {local:28} {remote}")
    assert len(ranks) == 1 and len(sockets) >= 6
    exposed = beyond_loopback(sockets)
    assert exposed == [], f"listening on or connected beyond loopback: {exposed}"
    store = Path(ranks[0][ranks[0].index("--rendezvous-file") + 1])
    assert not store.parent.exists(), "the rendezvous directory outlived the group's forming"


# ------------------------------------------------------------ multi-host ranks
@pytest.fixture
def server() -> Iterator[tuple[StoreServer, str]]:
    address = f"127.0.0.1:{free_port()}"
    server = StoreServer(address, RIGHT, world_size=2)
    yield server, address
    server.stop()


def _raw_calls(address: str, security: SecurityConfig) -> list[grpc.StatusCode]:
    """Every Rendezvous method called the way an attacker would, with `security`'s token."""
    with sync_channel(address, security=security) as channel:
        stub = pb_grpc.RendezvousStub(channel)
        calls = [
            (stub.Set, pb.SetRequest(key="0//cpu//0/1", value=b"rogue peer")),
            (stub.Get, pb.GetRequest(keys=["0//cpu//0/0"], wait_ms=0)),
            (stub.Add, pb.AddRequest(key="n", amount=1)),
            (stub.CompareSet, pb.CompareSetRequest(key="k", desired=b"x")),
            (stub.DeleteKey, pb.DeleteKeyRequest(key="0//cpu//0/0")),
            (stub.NumKeys, pb.NumKeysRequest()),
        ]
        codes = []
        for method, request in calls:
            try:
                method(request, timeout=5)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
    return codes


def test_store_needs_the_token_for_every_call(server: tuple[StoreServer, str]) -> None:
    store, address = server
    store.store.set("0//cpu//0/0", b"rank 0's address")
    for who in (NONE, WRONG):
        assert _raw_calls(address, who) == [grpc.StatusCode.UNAUTHENTICATED] * 6
    assert store.store.data == {"0//cpu//0/0": b"rank 0's address"}  # nothing written or deleted
    assert _raw_calls(address, RIGHT) == [grpc.StatusCode.OK] * 6


def test_store_total_size_is_capped(server: tuple[StoreServer, str]) -> None:
    store, address = server
    client = RemoteStore(address, RIGHT, timedelta(seconds=10))
    with pytest.raises(dist.DistStoreError):
        client.set("big", b"x" * (2 << 20))  # one message over 1 MiB
    megabyte = b"x" * ((1 << 20) - 64)
    written = 0
    with pytest.raises(dist.DistStoreError, match="store is full"):
        for i in range(64):  # the report's 300 x 1 MiB
            client.set(f"k{i}", megabyte)
            written += 1
    assert written == MAX_STORE_BYTES // (1 << 20) and store.store.size <= MAX_STORE_BYTES
    client.delete_key("k0")
    client.set("k0", megabyte)  # room again once a key is gone
    client.close()


def test_store_speaks_what_torch_asks(server: tuple[StoreServer, str]) -> None:
    _, address = server
    client = RemoteStore(address, RIGHT, timedelta(seconds=2))
    client.set("a", "1")
    assert client.get("a") == b"1" and client.check(["a"]) and not client.check(["a", "b"])
    assert client.add("n", 5) == 5 and client.add("n", -2) == 3 and client.get("n") == b"3"
    assert client.compare_set("c", "", "new") == b"new"
    assert client.compare_set("c", "old", "newer") == b"new"
    assert client.compare_set("absent", "old", "x") == b"old"
    assert client.num_keys() == 3 and client.delete_key("a") and not client.delete_key("a")
    with pytest.raises(dist.DistStoreError, match="timed out"):
        client.wait(["never"], timedelta(seconds=0.3))
    client.close()


def test_store_over_tls(pki: dict[str, SecurityConfig]) -> None:  # noqa: F811
    address = f"localhost:{free_port()}"
    server = StoreServer(address, pki["server"], world_size=2)
    try:
        client = RemoteStore(address, pki["client"], timedelta(seconds=5))
        client.set("k", b"v")
        assert client.get("k") == b"v"
        client.close()
        plaintext = RemoteStore(address, SecurityConfig(token=TOKEN), timedelta(seconds=1))
        with pytest.raises(dist.DistStoreError):
            plaintext.set("k", b"rogue")
        plaintext.close()
        assert server.store.data == {"k": b"v"}
    finally:
        server.stop()


def test_no_token_no_store() -> None:
    for make in (
        lambda: StoreServer(f"127.0.0.1:{free_port()}", NONE, 2),
        lambda: RemoteStore(f"127.0.0.1:{free_port()}", NONE, timedelta(seconds=1)),
    ):
        with pytest.raises(ValueError, match="need the internal token"):
            make()


def _python(code: str, *args: str, token: str = "") -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env.update(PYTHONPATH=str(REPO), **({TOKEN_ENV: token} if token else {}))
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], cwd=REPO, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


RANK = textwrap.dedent(
    """
    import socket, sys, torch
    from services.config import SecurityConfig
    from worker_service import parallel
    rank, method, token = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    how = parallel.RemoteRendezvous(method, SecurityConfig(token=token))
    group = parallel.init_group(rank, 2, how, torch.device("cpu"))
    t = torch.tensor([rank + 1.0])
    group.all_reduce(t)
    if rank:  # rank 0 sends it once its init_group returned
        assert group.receive() == ("stop",)
    host, port = method.removeprefix("tcp://").split(":")
    with socket.socket() as s:
        closed = s.connect_ex((host, int(port))) != 0
    print("sum", t.item(), "store closed" if closed else "store open", flush=True)
    group.stop()
    """
)


def test_rogue_rank_cannot_join_and_the_group_forms_with_the_token() -> None:
    method = f"tcp://127.0.0.1:{free_port()}"
    rank0 = _python(RANK, "0", method, TOKEN)
    try:
        rogue = _python(RANK, "1", method, "guess")
        _, err = rogue.communicate(timeout=120)
        assert rogue.returncode != 0 and "missing or invalid token" in err, err[-2000:]
        rank1 = _python(RANK, "1", method, TOKEN)
        out1, err1 = rank1.communicate(timeout=120)
        out0, err0 = rank0.communicate(timeout=60)
    finally:
        rank0.kill()
    assert (rank0.returncode, rank1.returncode) == (0, 0), err0[-2000:] + err1[-2000:]
    assert out0.strip() == out1.strip() == "sum 3.0 store closed"


@pytest.mark.parametrize("rank_args", [["--tp-no-spawn"], ["--tp-rank", "1"]])
def test_ranks_started_by_hand_refuse_to_start_without_a_token(rank_args: list[str]) -> None:
    args = ["--tensor-parallel-size", "2", "--tp-init-method", f"tcp://127.0.0.1:{free_port()}"]
    proc = _python("from worker_service.__main__ import main; main()", *args, *rank_args)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "need the internal token on every rank" in err, err[-2000:]


# ------------------------------------------------------ nothing executable crosses ranks
def test_worker_service_serializes_no_python_objects() -> None:
    """torch's *_object collectives (broadcast_object_list, all_gather_object, ...) and
    pickle run whatever a peer sends: none of them anywhere in worker_service."""
    banned = re.compile(r"pickle|_object_list\b|_object\(|marshal\.loads")
    hits = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in sorted((REPO / "worker_service").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if banned.search(line)
    ]
    assert hits == []
