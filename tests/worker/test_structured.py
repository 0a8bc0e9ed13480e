"""Structured output with the real default model: the grammar bitmask in the sampler.

Fast tests check the bitmask unpacking against a bit-by-bit reference. The slow ones run the
offline API (20 schemas x 3 seeds at temperature 1.0, regex, choice, n > 1: one batch, with
prefix caching and a token budget that chunks the prefills) and drive the worker directly (a
bad constraint fails only its request; a preempted request, re-sent with its output tokens,
replays them into a fresh matcher and continues exactly as without preemption).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from services.step_types import CachedRequestData, NewRequestData, SchedulerOutput
from services.types import SamplingParams, StructuredOutputParams
from tests.structured_schemas import SCHEMAS
from worker_service import sampler
from worker_service.sampler import apply_bitmask

SEEDS = (0, 1, 2)
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
CHOICES = ("positive", "negative", "neutral")
N_COPIES = 4  # n > 1 as the gateway sends it: n engine requests with one constraint


def _reference_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    words = bitmask.tolist()
    return torch.tensor(
        [[(row[t // 32] >> (t % 32)) & 1 == 1 for t in range(vocab)] for row in words]
    )


@pytest.mark.parametrize("rows", [[0, 1, 2], [1], [0, 2]])
def test_apply_bitmask_masks_exactly_the_zero_bits(rows: list[int]) -> None:
    vocab, batch = 70, 3  # not a multiple of 32: the tail bits are ignored
    gen = torch.Generator().manual_seed(len(rows))
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), 3), dtype=torch.int32, generator=gen)
    logits = torch.randn(batch, vocab, generator=gen)
    expected = logits.clone()
    allowed = _reference_allowed(bitmask, vocab)
    for i, r in enumerate(rows):
        expected[r] = expected[r].masked_fill(~allowed[i], float("-inf"))
    apply_bitmask(logits, torch.tensor(rows), bitmask)  # the C++ pass on CPU
    assert torch.equal(logits, expected)
    # the fallback without the C++ ops (numpy's unpackbits)
    assert torch.equal(sampler._unpack_bits(bitmask, torch.device("cpu"))[:, :vocab], allowed)
    # the accelerator path (a byte -> bits table gather), checked on CPU
    table = sampler._BYTE_BITS[bitmask.view(torch.uint8).long()].view(len(rows), -1)[:, :vocab]
    assert torch.equal(table, allowed)


# ---- offline API, real model ------------------------------------------------------------


def _chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def _cases() -> list[tuple[str, Any, SamplingParams, str]]:
    """(kind, expected, params, prompt) for one batch: schemas x seeds, regex, choice, n > 1."""
    cases: list[tuple[str, Any, SamplingParams, str]] = []
    for name, schema, prompt in SCHEMAS:
        constraint = StructuredOutputParams(json=json.dumps(schema))
        for seed in SEEDS:
            params = SamplingParams(
                temperature=1.0, seed=seed, max_tokens=256, structured_output=constraint
            )
            cases.append((f"json:{name}", schema, params, prompt))
    for seed in SEEDS:
        regex = SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=32,
            structured_output=StructuredOutputParams(regex=DATE),
        )
        cases.append(("regex", DATE, regex, "When did the war end? Give a date."))
        choice = SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=8,
            structured_output=StructuredOutputParams(choice=CHOICES),
        )
        cases.append(("choice", CHOICES, choice, "Sentiment of 'I love it'?"))
    shared = StructuredOutputParams(json=json.dumps(SCHEMAS[0][1]))
    for _ in range(N_COPIES):
        params = SamplingParams(temperature=1.0, max_tokens=256, structured_output=shared)
        cases.append(("n", SCHEMAS[0][1], params, SCHEMAS[0][2]))
    return cases


@pytest.fixture(scope="module")
def batch_results() -> Iterator[tuple[list[tuple[str, Any, SamplingParams, str]], list, Any]]:
    from tessera import LLM

    # 70 chat prompts of ~40 tokens under a 1024-token budget: the prefills are chunked; they
    # share the chat template's prefix, so the prefix cache hits. (Preemption under a
    # constraint is tested on the worker below: a small pool here made the batch thrash.)
    llm = LLM(kv_cache_memory="96MiB", max_num_batched_tokens=1024)
    cases = _cases()
    outputs = llm.chat([_chat(prompt) for *_, prompt in cases], [c[2] for c in cases])
    stats = llm.engine.stats()
    yield cases, outputs, stats
    llm.shutdown()


def _completions(results: Any, kind: str) -> list[tuple[Any, Any]]:
    cases, outputs, _ = results
    return [
        (expected, out.outputs[0])
        for (k, expected, _, _), out in zip(cases, outputs, strict=True)
        if k == kind or (kind == "json" and k.startswith("json:"))
    ]


@pytest.mark.slow
def test_every_schema_and_seed_gives_valid_json(batch_results: Any) -> None:
    import jsonschema

    done = _completions(batch_results, "json")
    assert len(done) == 60
    for schema, completion in done:
        assert completion.finish_reason == "stop", (completion.text, completion.error)
        jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.slow
def test_regex_and_choice_constraints_hold(batch_results: Any) -> None:
    for pattern, completion in _completions(batch_results, "regex"):
        assert completion.finish_reason == "stop"
        assert re.fullmatch(pattern, completion.text), completion.text
    for choices, completion in _completions(batch_results, "choice"):
        assert completion.finish_reason == "stop"
        assert completion.text in choices


@pytest.mark.slow
def test_n_copies_of_one_constraint_each_valid(batch_results: Any) -> None:
    import jsonschema

    copies = _completions(batch_results, "n")
    assert len(copies) == N_COPIES
    for schema, completion in copies:
        jsonschema.validate(json.loads(completion.text), schema)
    assert len({c.text for _, c in copies}) > 1  # unseeded samples differ


@pytest.mark.slow
def test_the_batch_hit_the_prefix_cache(batch_results: Any) -> None:
    _, _, stats = batch_results
    assert stats.prefix_cache_hits > 0


# ---- the worker directly -----------------------------------------------------------------


@pytest.fixture(scope="module")
def worker(tokenizer: Any) -> Iterator[Any]:
    from services.config import ModelConfig, WorkerConfig
    from worker_service.worker import Worker

    w = Worker(WorkerConfig(model=ModelConfig(dtype="float32"), max_num_seqs=8))
    w.initialize_cache(64)
    yield w
    w.shutdown()


def _prompt(tokenizer: Any, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        _chat(text), add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def _drive(
    worker: Any, rid: str, prompt: list[int], params: SamplingParams, steps: int, preempt_at: int
) -> list[int]:
    """Prefill, then decode until EOS; drop and re-send the request at step `preempt_at`."""
    blocks = list(range(8))
    so = SchedulerOutput(
        0,
        [NewRequestData(rid, prompt, [], params, blocks)],
        CachedRequestData(),
        {rid: len(prompt)},
    )
    outs: list[int] = []
    for step in range(1, steps):
        out = worker.execute_model(so)
        assert not out.request_errors, out.request_errors
        outs += out.sampled_token_ids
        if outs[-1] == 2:
            break
        if step == preempt_at:
            new = NewRequestData(rid, prompt, outs, params, blocks, resumed_from_preemption=True)
            so = SchedulerOutput(
                step, [new], CachedRequestData(), {rid: len(prompt) + len(outs)}, 0, [], [rid]
            )
        else:
            cached = CachedRequestData.of([(rid, len(prompt) + len(outs) - 1, [])])
            so = SchedulerOutput(step, [], cached, {rid: 1})
    worker.execute_model(SchedulerOutput(steps + 1, finished_req_ids=[rid]))
    return outs


@pytest.mark.slow
def test_resumed_request_replays_its_tokens_into_the_matcher(worker: Any, tokenizer: Any) -> None:
    schema = dict(SCHEMAS[4][1])  # nested_address
    params = SamplingParams(
        temperature=1.0,
        seed=5,
        max_tokens=80,
        structured_output=StructuredOutputParams(json=json.dumps(schema)),
    )
    prompt = _prompt(tokenizer, SCHEMAS[4][2])
    straight = _drive(worker, "straight", prompt, params, 80, preempt_at=-1)
    resumed = _drive(worker, "resumed", prompt, params, 80, preempt_at=6)
    assert resumed == straight
    assert straight[-1] == 2  # the grammar completed and only EOS was left
    import jsonschema

    jsonschema.validate(json.loads(tokenizer.decode(straight[:-1])), schema)


@pytest.mark.slow
def test_bad_constraint_in_the_worker_fails_only_its_request(worker: Any, tokenizer: Any) -> None:
    prompt = _prompt(tokenizer, "Is the sky blue?")
    good = SamplingParams(
        temperature=0, structured_output=StructuredOutputParams(choice=("yes", "no"))
    )
    bad = SamplingParams(temperature=0, structured_output=StructuredOutputParams(regex="(["))
    news = [
        NewRequestData("good", prompt, [], good, [0, 1, 2, 3]),
        NewRequestData("bad", prompt, [], bad, [4, 5, 6, 7]),
        NewRequestData("free", prompt, [], SamplingParams(temperature=0), [8, 9, 10, 11]),
    ]
    n = len(prompt)
    out = worker.execute_model(
        SchedulerOutput(0, news, CachedRequestData(), {r.request_id: n for r in news}, 3 * n)
    )
    assert set(out.request_errors) == {"bad"}
    assert "regex" in out.request_errors["bad"]
    sampled = out.sampled_by_request()
    first = tokenizer.decode(sampled["good"])
    assert "yes".startswith(first) or "no".startswith(first)
    assert sampled["free"]  # the unconstrained request ran in the same step
    worker.execute_model(SchedulerOutput(1, finished_req_ids=["good", "free"]))
