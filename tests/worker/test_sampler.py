"""Acceptance 3: the sampler (unit level, through build_sampling_batch) and seeded sampling
through a Worker (alone, in a batch, across preemption)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.config import ModelConfig, WorkerConfig
from services.step_types import CachedRequestData, NewRequestData, SchedulerOutput
from services.types import SamplingParams
from tests.worker.test_qwen_models import _save_tiny
from worker_service.input_batch import InputBatch, RequestState
from worker_service.sampler import Sampler, SamplerOutput, SamplingBatch
from worker_service.sampling_batch import build_sampling_batch, to_token_logprobs
from worker_service.worker import Worker

V = 64
EOS = (2,)
CPU = torch.device("cpu")


def _states(
    params: list[SamplingParams], prompt: list[int], outputs: list[int] | None = None
) -> tuple[list[RequestState], InputBatch]:
    batch = InputBatch(len(params), 128, 16, V)
    states = [
        batch.add(NewRequestData(f"r{i}", prompt, list(outputs or []), p, block_ids=[i]))
        for i, p in enumerate(params)
    ]
    return states, batch


def _sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt: tuple[int, ...] = (5,),
    outputs: list[int] | None = None,
    seed: int = 0,
) -> tuple[SamplerOutput, SamplingBatch]:
    states, batch = _states(params, list(prompt), outputs)
    sb = build_sampling_batch(states, batch, EOS, CPU)
    return Sampler(CPU, seed)(logits.clone(), sb), sb


def test_pure_greedy_batch_skips_everything() -> None:
    logits = torch.randn(4, V)
    out, sb = _sample(logits, [SamplingParams(temperature=0.0)] * 4)
    assert sb.all_greedy and sb.penalties is None and sb.top_k is None and sb.bias is None
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(8, V) * 3
    out, _ = _sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_temperature_sampling_follows_softmax() -> None:
    logits = torch.full((1, V), -30.0)
    logits[0, :4] = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = [SamplingParams(temperature=1.0)] * 4000
    out, _ = _sample(logits.expand(4000, V), params)
    freq = torch.bincount(out.token_ids, minlength=V)[:4].float() / 4000
    expected = torch.softmax(logits[0, :4], -1)
    assert torch.allclose(freq, expected, atol=0.03)


def test_top_p_and_min_p_never_sample_outside() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)]))
    out, _ = _sample(logits.expand(2000, V), [SamplingParams(top_p=0.7)] * 2000)
    assert set(out.token_ids.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7
    out, _ = _sample(logits.expand(2000, V), [SamplingParams(min_p=0.5)] * 2000)
    assert set(out.token_ids.tolist()) == {0, 1}  # floor 0.25
    out, _ = _sample(logits.expand(2000, V), [SamplingParams(top_k=3)] * 2000)
    assert set(out.token_ids.tolist()) == {0, 1, 2}


def test_penalties_and_bias_as_specified() -> None:
    logits = torch.linspace(-2, 2, V).unsqueeze(0).repeat(4, 1)
    prompt, outputs = [10, 60], [60, 60, 20]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(temperature=0.0, logit_bias={3: 100.0, 63: -100.0}),
    ]
    states, batch = _states(params, prompt, outputs)
    from worker_service.sampler import apply_constraints

    got = apply_constraints(logits.clone(), build_sampling_batch(states, batch, EOS, CPU))
    want = logits.clone()
    for t in (10, 60, 20):  # repetition: prompt and output tokens; positive /2, negative *2
        want[0, t] = logits[0, t] / 2 if logits[0, t] > 0 else logits[0, t] * 2
    want[1, 60] -= 1.0  # frequency 0.5 x 2 occurrences (prompt occurrences do not count)
    want[1, 20] -= 0.5
    want[2, 60] -= 1.5  # presence: once
    want[2, 20] -= 1.5
    want[3, 3] += 100.0
    want[3, 63] -= 100.0
    assert torch.allclose(got, want)
    out = Sampler(CPU)(logits.clone(), build_sampling_batch(states, batch, EOS, CPU))
    assert out.token_ids[3].item() == 3


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(2, V)
    logits[:, 2] = 10.0  # EOS
    logits[:, 7] = 9.0  # a stop id
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(7,), max_tokens=10),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(7,), max_tokens=10),
    ]
    out, _ = _sample(logits, params, outputs=[11, 12])  # two outputs so far
    assert out.token_ids.tolist()[0] not in (2, 7)
    assert out.token_ids.tolist()[1] == 2  # min_tokens reached


def test_logprobs_sanity() -> None:
    logits = torch.randn(3, V) * 2
    params = [
        SamplingParams(temperature=1.0, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(),
    ]
    out, _ = _sample(logits, params)
    entries = to_token_logprobs(out, [p.logprobs for p in params])
    ref = torch.log_softmax(logits, -1)
    assert entries[2] is None
    for i in (0, 1):
        e = entries[i]
        assert e is not None and e.token_id == out.token_ids[i].item()
        assert e.logprob == pytest.approx(ref[i, e.token_id].item(), abs=1e-5)
        assert e.rank == int((ref[i] > ref[i, e.token_id]).sum()) + 1
    first, second = entries[0], entries[1]
    assert first is not None and second is not None
    assert len(first.top_logprobs) == 5 and second.top_logprobs == []
    assert sum(math.exp(x) for x in first.top_logprobs) <= 1.0 + 1e-6
    assert first.top_logprobs == sorted(first.top_logprobs, reverse=True)


def test_seeded_rows_ignore_the_rest_of_the_batch() -> None:
    logits = torch.randn(1, V)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [_sample(logits, [seeded], seed=s)[0].token_ids[0].item() for s in range(5)]
    assert len(set(alone)) == 1  # the shared generator's seed does not matter
    batch_logits = torch.cat([torch.randn(3, V), logits, torch.randn(2, V)])
    params = [
        SamplingParams(),
        SamplingParams(seed=9),
        SamplingParams(top_p=0.5),
        seeded,
        SamplingParams(),
        SamplingParams(temperature=0.0),
    ]
    assert _sample(batch_logits, params, seed=77)[0].token_ids[3].item() == alone[0]


@pytest.fixture(scope="module")
def tiny_worker(tmp_path_factory: pytest.TempPathFactory) -> Worker:
    path: Path = _save_tiny("qwen2", tmp_path_factory.mktemp("qwen2-sampler"))
    worker = Worker(
        WorkerConfig(model=ModelConfig(model=str(path), dtype="float32"), max_num_seqs=8)
    )
    worker.initialize_cache(64)
    return worker


def _run(
    worker: Worker, reqs: dict[str, SamplingParams], steps: int, prefix: str, resume_at: int = -1
) -> dict[str, list[int]]:
    """Prefill then decode every request; optionally preempt and resume 's' at step resume_at."""
    prompt = [(3 * i + 1) % 320 for i in range(20)]
    blocks = {rid: [4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3] for k, rid in enumerate(reqs)}
    outs: dict[str, list[int]] = {rid: [] for rid in reqs}
    news = [NewRequestData(prefix + rid, prompt, [], p, blocks[rid]) for rid, p in reqs.items()]
    so = SchedulerOutput(
        0, news, CachedRequestData(), {prefix + r: 20 for r in reqs}, 20 * len(reqs)
    )
    for step in range(steps):
        out = worker.execute_model(so)
        for rid, tokens in out.sampled_by_request().items():
            outs[rid.removeprefix(prefix)] += tokens
        so = SchedulerOutput(step + 1, num_scheduled_tokens={prefix + r: 1 for r in reqs})
        for rid in reqs:
            if rid == "s" and step + 1 == resume_at:  # preempted: dropped, re-sent with outputs
                so.preempted_req_ids.append(prefix + rid)
                so.scheduled_new_reqs.append(
                    NewRequestData(
                        prefix + rid,
                        prompt,
                        outs[rid],
                        reqs[rid],
                        blocks[rid],
                        resumed_from_preemption=True,
                    )
                )
                so.num_scheduled_tokens[prefix + rid] = 20 + len(outs[rid])
            else:
                so.scheduled_cached_reqs.add(prefix + rid, 20 + len(outs[rid]) - 1, [])
    worker.execute_model(SchedulerOutput(steps + 1, finished_req_ids=[prefix + r for r in reqs]))
    return outs


def test_seeded_request_same_alone_in_batch_and_after_preemption(tiny_worker: Worker) -> None:
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=12)
    alone = _run(tiny_worker, {"s": seeded}, 12, "a-")["s"]
    others = {
        "x": SamplingParams(temperature=1.0, max_tokens=12),
        "y": SamplingParams(temperature=0.7, top_k=5, seed=7, max_tokens=12),
        "s": seeded,
        "z": SamplingParams(temperature=0.0, max_tokens=12),
    }
    assert _run(tiny_worker, others, 12, "b-")["s"] == alone
    assert _run(tiny_worker, others, 12, "c-", resume_at=5)["s"] == alone
    unseeded = _run(tiny_worker, {"s": SamplingParams(temperature=1.0, max_tokens=12)}, 12, "d-")[
        "s"
    ]
    assert unseeded != alone  # the seed, not the model, fixes the tokens (12 tokens over 320)


def test_argmax_rows_matches_argmax_and_takes_the_first_maximum() -> None:
    from worker_service.sampler import argmax_rows

    x = torch.randn(5, 1000)
    x[2, 10] = x[2, 700] = 99.0  # a tie: the first one wins
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x)[2].item() == 10
