"""`Strict`: the base of every OpenAI request model (strict JSON types, unknown fields refused)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class Strict(BaseModel):
    """Strict JSON types (no "10" for 10, no true for 1), no NaN or infinity, unknown fields
    refused with a 400 naming them; a field sent as JSON null counts as absent."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data
