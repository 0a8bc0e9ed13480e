"""The pooling config read from a model's files, the runner flags, PoolingParams checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.config import ModelConfig, resolve_runner
from services.pooling import PoolerConfig, check_pooling_params, read_pooler_config
from services.types import PoolingParams


def _model_dir(tmp_path: Path, config: dict[str, object], st: dict[str, bool] | None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, **config}))
    if st is not None:
        modules = [{"type": "sentence_transformers.models.Transformer", "path": ""}]
        modules.append({"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"})
        if st.pop("normalize", False):
            modules.append({"type": "sentence_transformers.models.Normalize", "path": "2_N"})
        (tmp_path / "modules.json").write_text(json.dumps(modules))
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(st))
    return tmp_path


def test_a_decoder_without_sentence_transformers_files_pools_its_last_token(
    tmp_path: Path,
) -> None:
    assert read_pooler_config(_model_dir(tmp_path, {}, None)) == PoolerConfig(
        "LAST", True, hidden_size=64
    )


@pytest.mark.parametrize(
    ("flag", "kind"),
    [
        ("pooling_mode_mean_tokens", "MEAN"),
        ("pooling_mode_cls_token", "CLS"),
        ("pooling_mode_lasttoken", "LAST"),
        ("pooling_mode_max_tokens", "MAX"),
    ],
)
@pytest.mark.parametrize("normalize", [True, False])
def test_sentence_transformers_pooling_modes(
    tmp_path: Path, flag: str, kind: str, normalize: bool
) -> None:
    flags = {"pooling_mode_mean_tokens": False, flag: True, "normalize": normalize}
    config = read_pooler_config(_model_dir(tmp_path, {}, flags))
    assert (config.pooling_type, config.normalize) == (kind, normalize)


def test_unsupported_pooling_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not supported"):
        read_pooler_config(_model_dir(tmp_path, {}, {"pooling_mode_weightedmean_tokens": True}))


def test_matryoshka_dimensions(tmp_path: Path) -> None:
    listed = read_pooler_config(_model_dir(tmp_path, {"matryoshka_dimensions": [16, 32]}, None))
    check_pooling_params(PoolingParams(dimensions=16), listed, "m")
    with pytest.raises(ValueError, match=r"only supports \[16, 32\]"):
        check_pooling_params(PoolingParams(dimensions=20), listed, "m")
    any_size = PoolerConfig(is_matryoshka=True, hidden_size=64)
    check_pooling_params(PoolingParams(dimensions=20), any_size, "m")
    with pytest.raises(ValueError, match="at most the model's hidden size"):
        check_pooling_params(PoolingParams(dimensions=65), any_size, "m")
    with pytest.raises(ValueError, match='Model "m" does not support matryoshka'):
        check_pooling_params(PoolingParams(dimensions=8), PoolerConfig(), "m")
    check_pooling_params(PoolingParams(), PoolerConfig(), "m")  # no dimensions: always fine
    with pytest.raises(ValueError, match="dimensions must be >= 1"):
        PoolingParams(dimensions=0)


def test_runner_and_its_task_alias() -> None:
    assert resolve_runner(None, None) == "generate"
    assert resolve_runner("pooling", None) == "pooling"
    assert resolve_runner(None, "embed") == "pooling"
    assert resolve_runner("pooling", "embed") == "pooling"
    with pytest.raises(ValueError, match="contradicts"):
        resolve_runner("generate", "embed")
    with pytest.raises(ValueError, match="task must be one of"):
        resolve_runner(None, "classify")
    with pytest.raises(ValueError, match="runner must be one of"):
        ModelConfig(runner="draft")  # type: ignore[arg-type]


def test_runner_flags_reach_the_worker_from_tessera_serve() -> None:
    from tessera.cli import build_parser, build_services
    from worker_service.__main__ import build_config, parse_args

    assert build_config(parse_args(["--task", "embed"])).model.runner == "pooling"
    assert build_config(parse_args([])).model.runner == "generate"
    args = build_parser().parse_args(["serve", "--runner", "pooling"])
    worker_argv = build_services(args, "token")[0].argv
    assert worker_argv[worker_argv.index("--runner") + 1] == "pooling"
    bad = build_parser().parse_args(["serve", "--runner", "generate", "--task", "embed"])
    with pytest.raises(ValueError, match="contradicts"):
        build_services(bad, "token")
