"""The fused decode step (worker_service/models/fused_decode.py, decode_layers.h) computes what
the layers compute one torch call at a time.

With the layers' GEMMs on the same few-row kernel (small_gemm.h) the two paths run the same
arithmetic in the same order, so greedy tokens must agree exactly over the real default model
in bf16, in every scheduling regime (batching, chunked prefill, prefix hits, preemption: the
steps the fused path does not take run the layers, and both must leave the same KV behind);
GGUF blocks take gemm_gguf on both paths as they are. Also: which models and steps it takes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from services.config import CacheConfig, ModelConfig, WorkerConfig
from services.types import SamplingParams
from tests.worker.driver import DriverRequest, MiniScheduler
from tests.worker.test_greedy_vs_hf import REGIMES
from worker_service.models import cpu_ops, fused_decode, onednn_bridge
from worker_service.models.fused_decode import FusedDecode
from worker_service.models.layers import Linear
from worker_service.worker import Worker

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ROWS = 8  # fused steps up to 8 decode rows, so that most decode steps of the regimes take it


def _worker(fused_rows: int, quantization: str = "none", **model: Any) -> Worker:
    config = WorkerConfig(
        model=ModelConfig(quantization=quantization, **model), fused_decode_rows=fused_rows
    )
    return Worker(config)


def _same_gemm_as_fused(worker: Worker) -> Worker:
    """The layers' dense GEMMs on the fused step's kernel at <= 8 rows (Linear.small_gemm;
    on AMX CPUs both paths take the AMX GEMM already, and with the oneDNN bridge the fused
    step takes the layers' choice of GEMM at every row count)."""
    if onednn_bridge.load() is not None:
        return worker
    ops = cpu_ops.load()
    assert ops is not None
    for module in worker.runner.model.modules():
        if isinstance(module, Linear) and module.quant is None:
            module.small_gemm = ops
    return worker


class CountingFused:
    """Counts the steps a FusedDecode ran natively."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps = 0
        run = FusedDecode._run

        def counted(fused: FusedDecode, *args: Any) -> None:
            self.steps += 1
            run(fused, *args)

        monkeypatch.setattr(FusedDecode, "_run", counted)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Worker, Worker]]:
    fused, layers = _worker(ROWS), _same_gemm_as_fused(_worker(0))
    yield fused, layers
    fused.shutdown()
    layers.shutdown()


def _greedy(worker: Worker, prompts: list[list[int]], regime: str) -> dict[str, list[int]]:
    num_blocks, budget, prefix, staggered = REGIMES[regime]
    block_size = worker.get_kv_cache_spec().block_size
    sched = MiniScheduler(worker, num_blocks, block_size, budget, 24, prefix_caching=prefix)
    for k, i in enumerate([2, 3, 4, 5, 0, 1, 6, 7]):
        arrival = 2 * k if staggered else 0
        sched.add(DriverRequest(f"{regime}-{i}", prompts[i], GREEDY, arrival_step=arrival))
    return sched.run()


@pytest.mark.parametrize("regime", list(REGIMES))
def test_fused_greedy_equals_the_layers(
    regime: str,
    pair: tuple[Worker, Worker],
    eight_prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fused, layers = pair
    counter = CountingFused(monkeypatch)
    got = _greedy(fused, eight_prompts, regime)
    assert isinstance(fused.runner.forward, FusedDecode)
    assert counter.steps >= 10  # the decode steps of up to 8 requests went native
    fused_steps = counter.steps
    want = _greedy(layers, eight_prompts, regime)
    assert counter.steps == fused_steps  # the layers' worker never took the fused step
    assert got == want


def test_gguf_blocks_fused_equal_the_layers(
    eight_prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default model's Q4_1 GGUF file: both paths run gemm_gguf on the blocks."""
    counter = CountingFused(monkeypatch)
    fused = _worker(-1, "gguf")
    got = _greedy(fused, eight_prompts, "one_batch")
    fused.shutdown()
    assert counter.steps > 20  # every decode step: GGUF blocks take up to 64 rows
    layers = _worker(0, "gguf")
    want = _greedy(layers, eight_prompts, "one_batch")
    layers.shutdown()
    assert got == want


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_fused_equals_the_layers(
    cache_dtype: str, eight_prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quantized KV cache: the fused step quantizes K and V per slot and head as
    kv_quant.write does (int8: K and the queries Hadamard-rotated, kv_rotation) and reads them
    with the same kernel, so greedy agrees exactly with the layers."""
    counter = CountingFused(monkeypatch)
    cache = CacheConfig(cache_dtype=cache_dtype)
    fused = Worker(WorkerConfig(model=ModelConfig(), cache=cache, fused_decode_rows=ROWS))
    got = _greedy(fused, eight_prompts, "preemption")
    fused.shutdown()
    assert counter.steps >= 10
    layers = Worker(WorkerConfig(model=ModelConfig(), cache=cache, fused_decode_rows=0))
    want = _greedy(_same_gemm_as_fused(layers), eight_prompts, "preemption")
    layers.shutdown()
    assert got == want


def test_steps_it_does_not_take_run_the_layers(pair: tuple[Worker, Worker]) -> None:
    fused = pair[0].runner.forward
    assert isinstance(fused, FusedDecode)
    meta = _meta([1] * 3)
    ids, positions = torch.zeros(3, dtype=torch.int64), torch.arange(3)
    assert fused.takes(meta, ids, positions)
    assert not fused.takes(_meta([1] * 9), torch.zeros(9, dtype=torch.int64), torch.arange(9))
    assert not fused.takes(_meta([1, 2]), ids, positions)  # a prefill chunk in the step
    assert not fused.takes(_meta([1] * 3, verify=[0]), ids, positions)  # drafts to verify
    assert not fused.takes(meta, ids, torch.zeros(3, 3))  # M-RoPE positions


@pytest.mark.parametrize(
    ("why", "fused_rows", "model", "cache"),
    [
        ("off", 0, {}, {}),
        ("float32 (exact, layer by layer)", -1, {"dtype": "float32"}, {}),
        ("HF's exact kernels", -1, {"hf_exact_numerics": True}, {}),
        ("batch-invariant GEMMs", -1, {"deterministic": True}, {}),
    ],
)
def test_models_it_does_not_take(
    why: str, fused_rows: int, model: dict[str, Any], cache: dict[str, Any]
) -> None:
    config = WorkerConfig(
        model=ModelConfig(**model), cache=CacheConfig(**cache), fused_decode_rows=fused_rows
    )
    worker = Worker(config)
    worker.initialize_cache(16)
    assert worker.runner.forward is worker.runner.model, why
    worker.shutdown()


def test_rows_by_weight_format(pair: tuple[Worker, Worker]) -> None:
    pair[0].initialize_cache(16)  # the pools it binds (every test's scheduler sets its own)
    model = pair[0].runner.model
    built = fused_decode.build(model, pair[0].runner.backend, -1)
    amx = any(isinstance(m, Linear) and m.amx is not None for m in model.modules())
    dense = fused_decode.ONEDNN_ROWS if onednn_bridge.load() else fused_decode.DENSE_ROWS
    rows = fused_decode.AMX_ROWS if amx else dense  # AMX CPUs: on both paths
    assert built is not None and built.max_rows == rows


def test_many_rows_take_onednn_and_equal_the_layers(
    eight_prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past 8 rows the fused step calls back into oneDNN (onednn_bridge) over the layers' own
    packed weights: 24 requests decode together, and greedy agrees exactly with the layers."""
    if onednn_bridge.load() is None:
        pytest.skip("the oneDNN bridge cannot be built here (no torch headers or no oneDNN)")
    rows: list[int] = []
    run = FusedDecode._run

    def counted(fused: FusedDecode, x: torch.Tensor, *args: Any) -> None:
        rows.append(x.shape[0])
        run(fused, x, *args)

    monkeypatch.setattr(FusedDecode, "_run", counted)
    prompts = [p[: 20 + 7 * k] for k in range(3) for p in eight_prompts]  # 24 requests
    got = _many(_worker(-1), prompts)
    assert max(rows) == 24 and len(rows) >= 20
    assert got == _many(_worker(0), prompts)


def _many(worker: Worker, prompts: list[list[int]]) -> dict[str, list[int]]:
    block_size = worker.get_kv_cache_spec().block_size
    sched = MiniScheduler(worker, 256, block_size, 4096, 24)
    for i, prompt in enumerate(prompts):
        sched.add(DriverRequest(f"many-{i}", prompt, GREEDY))
    out = sched.run()
    worker.shutdown()
    return out


def _meta(query_lens: list[int], verify: list[int] | None = None) -> Any:
    from worker_service.attention.base import AttentionMetadata

    n = len(query_lens)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=starts,
        seq_lens=torch.full((n,), 8, dtype=torch.int32),
        block_table=torch.zeros(n, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=8,
        query_lens_cpu=query_lens,
        seq_lens_cpu=[8] * n,
        verify_reqs=verify or [],
    )
