"""OutputProcessor: engine outputs of one request -> text deltas (real tokenizer)."""

from __future__ import annotations

import pytest

from gateway.errors import EngineError
from gateway.output import OutputProcessor
from gateway.tokenizer import Tokenizer
from services.types import EngineCoreOutput, FinishReason

pytestmark = pytest.mark.slow
TEXT = "Olá 😀 and 日本語 done"


def outputs(
    ids: list[int], finish: FinishReason, stop_reason: int | None = None
) -> list[EngineCoreOutput]:
    outs = [EngineCoreOutput("r", [t]) for t in ids]
    outs[-1].finish_reason, outs[-1].stop_reason = finish, stop_reason
    return outs


def test_stop_token_id_is_not_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    proc = OutputProcessor(0, tokenizer, stop=(), skip_special_tokens=False)
    deltas = [proc.on_output(o) for o in outputs([*ids, 2], FinishReason.STOP, 2)]
    assert "".join(d.text for d in deltas) == TEXT  # no "<|im_end|>" even with specials kept
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == 2
    assert sum(len(d.token_ids) for d in deltas) == len(ids) + 1


def test_stop_string_ends_the_choice(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    proc = OutputProcessor(3, tokenizer, stop=["日本"])
    deltas = []
    for out in outputs(ids, FinishReason.LENGTH):
        deltas.append(proc.on_output(out))
        if deltas[-1].finish_reason:
            break
    assert "".join(d.text for d in deltas) == "Olá 😀 and "
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "日本"
    assert {d.index for d in deltas} == {3}


def test_length_finish_and_engine_error(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    proc = OutputProcessor(0, tokenizer)
    assert [proc.on_output(o).finish_reason for o in outputs(ids, FinishReason.LENGTH)][
        -1
    ] == "length"
    failing = EngineCoreOutput("r", [], finish_reason=FinishReason.ERROR, error="worker died")
    with pytest.raises(EngineError, match="worker died"):
        OutputProcessor(0, tokenizer).on_output(failing)
