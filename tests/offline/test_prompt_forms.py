"""The offline `LLM.generate` takes vLLM's prompt forms; a bad prompt is a clear error that
names its index, raised before anything is queued, and the next good call still works."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from services.types import EngineCoreRequest, SamplingParams
from tessera import LLM

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(dtype="float32", kv_cache_memory="256MiB", max_num_seqs=8)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def text_ids(llm: LLM) -> list[int]:
    return llm.tokenizer.encode(TEXT)


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_every_prompt_form_gives_the_same_tokens(llm: LLM, text_ids: list[int]) -> None:
    [expected] = _tokens(llm.generate(TEXT, GREEDY))
    assert len(expected) == 4
    forms: list[Any] = [
        text_ids,
        {"prompt": TEXT},
        {"prompt_token_ids": text_ids},
        [TEXT],
        [text_ids],
        [{"prompt": TEXT}],
        [{"prompt_token_ids": text_ids}],
    ]
    for form in forms:
        assert _tokens(llm.generate(form, GREEDY)) == [expected], form
    every: list[Any] = [TEXT, text_ids, {"prompt": TEXT}, {"prompt_token_ids": text_ids}]
    mixed = llm.generate(every, GREEDY)
    assert _tokens(mixed) == [expected] * 4
    assert [o.prompt for o in mixed] == [TEXT, None, TEXT, None]
    assert all(o.prompt_token_ids == text_ids for o in mixed)


BAD: list[tuple[Any, type[Exception], str]] = [
    ({"prompt_token_ids": ["a", "b"]}, TypeError, "prompt 0: token ids must be integers"),
    ([{"prompt": TEXT}, {"prompt_token_ids": [1, 2.5]}], TypeError, "prompt 1: token ids"),
    ({"prompt": 3}, TypeError, "prompt 0: 'prompt' must be a str"),
    ({"prompt_token_ids": "abc"}, TypeError, "'prompt_token_ids' must be a list of int"),
    ({"text": TEXT}, ValueError, "prompt 0: a dict prompt has exactly one of the keys"),
    ({"prompt": TEXT, "prompt_token_ids": [1]}, ValueError, "exactly one of the keys"),
    ([TEXT, 3.5], TypeError, "prompt 1 must be a str, a list of token ids"),
    ([TEXT, None], TypeError, "prompt 1 must be"),
    ([[1, 2], [True, 2]], TypeError, "prompt 1: token ids must be integers, found bool"),
    ({"prompt_token_ids": []}, ValueError, "prompt 0 has no token ids"),
    ("", ValueError, "prompt 0 is empty"),
    ([], ValueError, "no prompts given"),
    (42, TypeError, "prompts must be a prompt or a list of prompts"),
    ([TEXT, [10**9]], ValueError, r"prompt 1: prompt token ids must be in \[0, 49152\)"),
]


@pytest.mark.parametrize(("prompts", "error", "message"), BAD)
def test_bad_prompt_is_a_clear_error_and_queues_nothing(
    llm: LLM, text_ids: list[int], prompts: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        llm.generate(prompts, GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.pool.num_used_blocks == 0
    assert len(_tokens(llm.generate({"prompt_token_ids": text_ids}, GREEDY))[0]) == 4


def test_engine_rejects_non_integer_token_ids(llm: LLM) -> None:
    for ids in (["a"], [1.0], [True]):
        with pytest.raises(ValueError, match="prompt token ids must be integers"):
            llm.engine.add_request(EngineCoreRequest("x", ids, GREEDY))  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished_requests()
