"""Property: the incremental detokenizer's deltas plus flush() equal the one-shot decode,
for random token id sequences of the real tokenizer fed in random step sizes."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.detokenizer import IncrementalDetokenizer
from gateway.tokenizer import Tokenizer
from tests.gateway.conftest import tokenizer  # noqa: F401 (session fixture)

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _ids(vocab: int) -> st.SearchStrategy[list[int]]:
    """Token ids: any in the vocabulary, biased to byte tokens and special ids (0..300),
    where split characters and skipped tokens live."""
    low = st.integers(0, 300)
    return st.lists(st.one_of(low, st.integers(0, vocab - 1)), max_size=40)


@SETTINGS
@given(data=st.data())
def test_incremental_equals_one_shot(tokenizer: Tokenizer, data: st.DataObject) -> None:  # noqa: F811
    ids = data.draw(_ids(tokenizer.vocab_size), label="ids")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    out, i = [], 0
    while i < len(ids):
        step = data.draw(st.integers(1, 4), label="step")
        out.append(detok.update(ids[i : i + step]))
        i += step
    out.append(detok.flush())
    assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert detok.text == "".join(out)


def test_regression_added_special_token_is_skipped(tokenizer: Tokenizer) -> None:  # noqa: F811
    """Found by the fuzzer: id 3 (<repo_name>) is an added special token outside
    all_special_ids; decode(skip_special_tokens=True) drops it, so must the stream."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    text = detok.update([3, 28, 3]) + detok.flush()
    assert text == tokenizer.decode([3, 28, 3]) and "<repo_name>" not in text
