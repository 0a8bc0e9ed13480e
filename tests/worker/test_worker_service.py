"""The Worker gRPC service as a process: CLI, health, handshake, per-request errors, a failing
step that leaves the server up, Shutdown and SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_service.worker_client import GrpcWorkerClient
from services.step_types import CachedRequestData, NewRequestData, SchedulerOutput
from services.types import SamplingParams
from tests.worker.conftest import REPO, spawn_worker, stop_worker
from tests.worker.test_qwen_models import _save_tiny

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny("qwen3", tmp_path_factory.mktemp("qwen3-service"))


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Iterator[tuple[GrpcWorkerClient, object]]:
    proc, address = spawn_worker(
        "--model", str(tiny_dir), "--dtype", "float32", "--kv-cache-memory", "64MiB"
    )
    client = GrpcWorkerClient(address)
    yield client, proc
    client.close()
    if proc.poll() is None:
        assert stop_worker(proc) == 0


def test_help_lists_the_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "worker_service", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in (
        "--model",
        "--dtype",
        "--block-size",
        "--kv-cache-memory",
        "--max-model-len",
        "--attention-backend",
        "--num-threads",
    ):
        assert flag in out


def test_unsupported_architecture_is_a_clear_error(tiny_dir: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "worker_service", "--model", str(tmp_path), "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "unsupported model architecture 'GPT2LMHeadModel'" in proc.stderr


def test_handshake(served: tuple[GrpcWorkerClient, object]) -> None:
    client, _ = served
    info = client.get_model_info()
    assert (
        info.vocab_size == 320
        and info.architecture == "Qwen3ForCausalLM"
        and info.max_model_len == 256
    )
    spec = client.get_kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size) == (2, 2, 32, 16)
    assert spec.bytes_per_block == 2 * 2 * 16 * 2 * 32 * 4
    assert client.determine_available_memory() == 64 << 20
    assert client.initialize_cache(16) == 16 * spec.bytes_per_block


def test_request_errors_and_failed_step_keep_the_server_up(
    served: tuple[GrpcWorkerClient, object],
) -> None:
    client, _ = served
    client.initialize_cache(16)
    good = NewRequestData(
        "ok", [1, 2, 3], sampling_params=SamplingParams(temperature=0.0), block_ids=[0]
    )
    bad = NewRequestData(
        "bad", [1, 2], sampling_params=SamplingParams(logit_bias={999: 1.0}), block_ids=[1]
    )
    out = client.execute_model(
        SchedulerOutput(1, [good, bad], CachedRequestData(), {"ok": 3, "bad": 2}, 5)
    )
    assert out.req_ids == ["ok"] and len(out.sampled_token_ids) == 1
    assert "logit_bias token id 999" in out.request_errors["bad"]
    broken = NewRequestData("oob", [1, 2], block_ids=[10_000])  # a block outside the pool
    with pytest.raises(RuntimeError, match="INTERNAL"):
        client.execute_model(SchedulerOutput(2, [broken], CachedRequestData(), {"oob": 2}, 2))
    out = client.execute_model(
        SchedulerOutput(
            3, [], CachedRequestData.of([("ok", 3, [])]), {"ok": 1}, 1, finished_req_ids=["oob"]
        )
    )
    assert out.req_ids == ["ok"] and len(out.sampled_token_ids) == 1
    assert client.is_serving()


def test_shutdown_rpc_stops_the_process(
    served: tuple[GrpcWorkerClient, subprocess.Popen[bytes]],
) -> None:
    client, proc = served
    client.shutdown()
    assert proc.wait(timeout=30) == 0
