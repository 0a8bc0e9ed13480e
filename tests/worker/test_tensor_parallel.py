"""Issue 13, tensor parallelism: a model split over 2 ranks (gloo on CPU, float32) gives the
same greedy tokens as 1 rank and as HF generate, whether its KV heads split evenly (2 over 2)
or not (3 over 2, like the default model); each rank holds about half the layer weights and
its share of the KV heads; the ranks die with rank 0; impossible splits are refused clearly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from services.config import ModelConfig, ParallelConfig, WorkerConfig
from services.types import SamplingParams
from services.worker_api import WorkerProtocol
from tests.hf_reference import hf_greedy
from tests.worker.conftest import spawn_worker, stop_worker
from tests.worker.driver import DriverRequest, MiniScheduler
from tests.worker.test_qwen_models import TINY  # vocab 320, hidden 64, 4 heads over 2 KV
from worker_service.worker import Worker

PROMPTS = [[(7 * i + 3 * k + 1) % 320 for i in range(n)] for k, n in enumerate((5, 40, 23, 61))]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _save_tiny(path: Path, **overrides: Any) -> Path:
    """A random-weight Llama (GQA, untied head) saved the HF way."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}, tie_word_embeddings=False))
    with torch.no_grad():  # HF sets norms to 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 q heads over 2 KV heads: splits evenly over 2 ranks."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny_llama_3kv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 q heads over 3 KV heads (the default model's 9 over 3, smaller): 2 + 1 KV heads."""
    return _save_tiny(
        tmp_path_factory.mktemp("tiny-llama-3kv"),
        num_attention_heads=6,
        num_key_value_heads=3,
        hidden_size=96,
    )


def _config(path: Path, tp: int) -> WorkerConfig:
    return WorkerConfig(
        model=ModelConfig(model=str(path), dtype="float32"),
        max_num_seqs=8,
        parallel=ParallelConfig(tensor_parallel_size=tp),
    )


def _generate(worker: WorkerProtocol) -> dict[str, list[int]]:
    """The prompts through a small scheduler: chunked prefill (budget 32), then decode."""
    sched = MiniScheduler(worker, 64, worker.get_kv_cache_spec().block_size, 32, NEW_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        sched.add(DriverRequest(str(i), prompt, GREEDY, arrival_step=i))
    outputs = sched.run()
    assert sched.stats.chunked_steps > 0
    return outputs


def _layer_bytes(worker: Worker) -> tuple[int, int]:
    """Bytes of the decoder layers' projections (split) and of their norms (replicated)."""
    named = list(worker.runner.model.layers.named_parameters())
    sizes = [(n, p.numel() * p.element_size()) for n, p in named]
    return sum(b for n, b in sizes if "norm" not in n), sum(b for n, b in sizes if "norm" in n)


def test_tp2_greedy_equals_tp1_and_hf(tiny_llama: Path) -> None:
    """Even split: exactly half of every projection and of the KV heads on rank 0."""
    expected = hf_greedy(tiny_llama, PROMPTS, NEW_TOKENS, "float32")
    single = Worker(_config(tiny_llama, 1))
    one = _generate(single)
    one_bytes, one_spec = _layer_bytes(single), single.get_kv_cache_spec()
    single.shutdown()
    split = Worker(_config(tiny_llama, 2))
    try:
        (child,) = split.tp.children
        assert child.poll() is None
        two = _generate(split)
        spec = split.get_kv_cache_spec()
        assert spec.num_kv_heads == one_spec.num_kv_heads // 2 == 1
        assert spec.bytes_per_block * 2 == one_spec.bytes_per_block
        projections, norms = _layer_bytes(split)
        assert (2 * projections, norms) == one_bytes
        assert split.determine_available_memory() > 0  # the min over both ranks
    finally:
        split.shutdown()
    assert child.wait(timeout=30) == 0  # stopped by rank 0, cleanly
    for i in range(len(PROMPTS)):
        assert one[str(i)] == expected[i], f"tp=1 prompt {i}"
        assert two[str(i)] == expected[i], f"tp=2 prompt {i}"


def test_tp2_over_3_kv_heads_equals_hf_with_balanced_weights(tiny_llama_3kv: Path) -> None:
    """Uneven split: rank 0 takes 2 KV heads (4 q heads), rank 1 one; the MLP columns
    balance the bytes, so each rank still holds about half the layer weights."""
    expected = hf_greedy(tiny_llama_3kv, PROMPTS, NEW_TOKENS, "float32")
    single = Worker(_config(tiny_llama_3kv, 1))
    whole, _ = _layer_bytes(single)
    single.shutdown()
    split = Worker(_config(tiny_llama_3kv, 2))
    try:
        two = _generate(split)
        assert split.get_kv_cache_spec().num_kv_heads == 2
        attention = split.runner.model.attention_layers()[0]
        assert (attention.num_heads, attention.num_kv_heads) == (4, 2)
        rank0, _ = _layer_bytes(split)
        assert abs(rank0 / whole - 0.5) < 0.05, rank0 / whole
    finally:
        split.shutdown()
    for i in range(len(PROMPTS)):
        assert two[str(i)] == expected[i], f"tp=2 prompt {i}"


def test_impossible_split_is_refused_before_any_rank_starts(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 3 exceeds the model's num_key"):
        Worker(_config(tiny_llama, 3))


def test_parallel_config_is_validated() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        ParallelConfig(tensor_parallel_size=0)


def _children(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    ).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.is_file() and stat.read_text().split()[2] == "Z")


def test_worker_process_starts_its_rank_which_dies_with_it(tiny_llama: Path) -> None:
    proc, _address = spawn_worker(
        "--model", str(tiny_llama), "--dtype", "float32", "--tensor-parallel-size", "2"
    )
    (rank1,) = _children(proc.pid)
    assert _alive(rank1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while _alive(rank1) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(rank1)


def test_rank0_exits_when_its_rank_dies(tiny_llama: Path) -> None:
    """A dead rank breaks the group: rank 0 exits (non-zero) so its supervisor restarts it."""
    proc, _address = spawn_worker(
        "--model", str(tiny_llama), "--dtype", "float32", "--tensor-parallel-size", "2"
    )
    (rank1,) = _children(proc.pid)
    os.kill(rank1, signal.SIGKILL)
    try:
        assert proc.wait(timeout=15) != 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_stops_rank0_and_its_rank_cleanly(tiny_llama: Path) -> None:
    proc, _address = spawn_worker(
        "--model", str(tiny_llama), "--dtype", "float32", "--tensor-parallel-size", "2"
    )
    (rank1,) = _children(proc.pid)
    assert stop_worker(proc) == 0
    assert not _alive(rank1)


def test_ranks_started_by_hand_join_over_tcp_and_env(tiny_llama: Path) -> None:
    """The multi-host form: rank 0 does not spawn (--tp-no-spawn, MASTER_ADDR/MASTER_PORT);
    rank 1 is its own `python -m worker_service --tp-rank 1 --tp-init-method tcp://...`;
    both have the internal token, which guards the rendezvous rank 0 serves on that port.
    The gRPC worker they form answers like HF; rank 1 exits when rank 0 stops."""
    from scheduler_service.worker_client import GrpcWorkerClient
    from services.config import SecurityConfig
    from services.grpc_utils import internal_security, set_internal_security
    from services.security import TOKEN_ENV
    from tests.conftest import free_port
    from tests.worker.conftest import REPO

    port, token = free_port(), "tp-by-hand-token"
    common = ["--model", str(tiny_llama), "--dtype", "float32", "--num-threads", "1"]
    common += ["--tensor-parallel-size", "2"]
    by_hand = ["--tp-rank", "1", "--tp-init-method", f"tcp://127.0.0.1:{port}"]
    rank1 = subprocess.Popen(
        [sys.executable, "-m", "worker_service", *common, *by_hand],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), TOKEN_ENV: token},
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{TOKEN_ENV: token})
    try:
        proc, address = spawn_worker(*common, "--tp-no-spawn")
    finally:
        del os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], os.environ[TOKEN_ENV]
    before = internal_security()
    set_internal_security(SecurityConfig(token=token))
    try:
        assert _children(proc.pid) == []
        client = GrpcWorkerClient(address)
        outputs = _generate(client)
        client.close()
    finally:
        set_internal_security(before)
        assert stop_worker(proc) == 0
    assert rank1.wait(timeout=30) == 0
    expected = hf_greedy(tiny_llama, PROMPTS, NEW_TOKENS, "float32")
    assert [outputs[str(i)] for i in range(len(PROMPTS))] == expected


@pytest.mark.slow
def test_offline_llm_takes_tensor_parallel_size(default_model_dir: Path) -> None:
    """`LLM(tensor_parallel_size=2)`: the default model (3 KV heads: 2 + 1) split over two
    ranks in float32 generates HF's greedy tokens; shutdown stops rank 1."""
    from tessera import LLM

    prompts = [[1, 504, 3458, 282, 4649, 314], PROMPTS[2]]
    llm = LLM(dtype="float32", kv_cache_memory="256MiB", tensor_parallel_size=2)
    try:
        (child,) = llm.worker.tp.children
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert child.wait(timeout=30) == 0
    expected = hf_greedy(default_model_dir, prompts, NEW_TOKENS, "float32")
    assert [o.outputs[0].token_ids for o in outputs] == expected
