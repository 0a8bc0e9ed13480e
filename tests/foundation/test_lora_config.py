"""The LoRA flags: vLLM's names, `name=path` and JSON module forms, validated once, and passed
by `tessera serve` to the worker, the scheduler and the gateway alike."""

from __future__ import annotations

import pytest

from gateway.__main__ import config_from_args
from gateway.__main__ import parse_args as gateway_args
from scheduler_service.__main__ import configs
from scheduler_service.__main__ import parse_args as scheduler_args
from services.config import WorkerConfig
from services.lora_config import LoRAConfig, LoRAModule, parse_lora_module
from tessera.cli import build_parser, build_services
from worker_service.__main__ import build_config
from worker_service.__main__ import parse_args as worker_args

JSON_MODULE = '{"name": "sql", "path": "/adapters/sql", "base_model_name": "tiny"}'


def test_module_forms() -> None:
    assert parse_lora_module("a=/x/y") == LoRAModule("a", "/x/y")
    assert parse_lora_module(JSON_MODULE) == LoRAModule("sql", "/adapters/sql", "tiny")
    for bad in ("a", "=x", '{"name": "a"}', "{nope"):
        with pytest.raises(ValueError, match=r"lora-modules|needs a name"):
            parse_lora_module(bad)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="need enable_lora"):
        LoRAConfig(lora_modules=(LoRAModule("a", "/x"),))
    with pytest.raises(ValueError, match="max_loras"):
        LoRAConfig(enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras must be >= max_loras"):
        LoRAConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="unique"):
        LoRAConfig(enable_lora=True, lora_modules=(LoRAModule("a", "/x"), LoRAModule("a", "/y")))
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        from services.config import ParallelConfig

        WorkerConfig(lora=LoRAConfig(enable_lora=True), parallel=ParallelConfig(2))


def test_serve_passes_the_same_lora_config_to_every_service() -> None:
    argv = ["serve", "--enable-lora", "--lora-modules", "a=/x", JSON_MODULE, "--max-loras", "3",
            "--max-lora-rank", "32", "--max-cpu-loras", "5", "--allow-runtime-lora-updating"]  # fmt: skip
    worker, scheduler, gateway = build_services(build_parser().parse_args(argv), "token")
    expected = LoRAConfig(
        True, 3, 32, 5, (LoRAModule("a", "/x"), LoRAModule("sql", "/adapters/sql", "tiny")), True
    )
    assert build_config(worker_args(worker.argv[3:])).lora == expected
    assert configs(scheduler_args(scheduler.argv[3:]))[0].lora == expected
    assert config_from_args(gateway_args(gateway.argv[3:])).lora == expected


def test_lora_off_adds_no_flags() -> None:
    services = build_services(build_parser().parse_args(["serve"]), "token")
    assert not any(arg.startswith("--") and "lora" in arg for s in services for arg in s.argv)
