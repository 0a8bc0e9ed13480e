"""`--model ORG/NAME`: Hub ids resolve through a Hugging Face cache laid out as
huggingface_hub writes it (built here in a temporary HF_HOME; nothing is downloaded)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoTokenizer

from benchmarks.stack import REPO, start_stack
from services.config import HubConfig
from services.default_model import resolve_model, served_name
from services.hub import is_hub_id
from tests.hf_reference import hf_greedy

OLD, NEW = "a" * 40, "b" * 40  # two commits of acme/tiny; main and the tag v2 point at NEW


def _tiny_llama(out: Path, tokenizer_dir: Path, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / "models--acme--tiny"
    for seed, commit in enumerate((OLD, NEW)):
        _tiny_llama(repo / "snapshots" / commit, default_model_dir, seed)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(NEW)
    (repo / "refs" / "v2").write_text(NEW)
    return home


@pytest.fixture
def offline(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_home


def test_hub_ids_are_told_from_paths(tmp_path: Path) -> None:
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("acme/tiny.v2")
    assert not is_hub_id("default") and not is_hub_id("/models/x") and not is_hub_id("a/b/c")
    (tmp_path / "org" / "name").mkdir(parents=True)
    os.chdir(tmp_path)
    try:
        assert not is_hub_id("org/name")  # an existing relative path wins
    finally:
        os.chdir(REPO)
    assert served_name("acme/tiny") == "acme/tiny"  # served under the id, as vLLM does


def test_revision_pins_pick_the_right_snapshot(offline: Path) -> None:
    snapshots = offline / "hub" / "models--acme--tiny" / "snapshots"
    assert resolve_model("acme/tiny") == snapshots / NEW
    assert resolve_model("acme/tiny", HubConfig(revision="v2")) == snapshots / NEW
    assert resolve_model("acme/tiny", HubConfig(revision=OLD)) == snapshots / OLD


def test_download_dir_is_the_cache_searched(offline: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        resolve_model("acme/tiny", HubConfig(download_dir=str(tmp_path)))
    path = resolve_model("acme/tiny", HubConfig(download_dir=str(offline / "hub")))
    assert path.name == NEW


def test_offline_and_missing_is_a_clear_error(offline: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        resolve_model("acme/missing")
    message = str(info.value)
    assert "'acme/missing'" in message and str(offline / "hub") in message
    assert "HF_HUB_OFFLINE" in message
    with pytest.raises(FileNotFoundError, match="revision 'v9'"):
        resolve_model("acme/tiny", HubConfig(revision="v9"))


def test_tessera_serve_offline_and_missing_exits_with_the_reason(offline: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tessera", "serve", "--model", "acme/missing"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "acme/missing" in result.stderr and str(offline / "hub") in result.stderr


@pytest.mark.slow
def test_tessera_serve_a_hub_id_offline(offline: Path) -> None:
    stack = start_stack("--model", "acme/tiny", "--revision", OLD, "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["acme/tiny"]
        prompt = [1, 520, 1410, 314, 2136]
        reply = client.completions.create(
            model="acme/tiny", prompt=prompt, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        snapshots = offline / "hub" / "models--acme--tiny" / "snapshots"
        [pinned] = hf_greedy(snapshots / OLD, [prompt], 8)
        [latest] = hf_greedy(snapshots / NEW, [prompt], 8)
        assert pinned != latest  # the pin is observable: the two snapshots answer differently
        tokenizer: Any = AutoTokenizer.from_pretrained(snapshots / OLD)
        assert reply.choices[0].text == tokenizer.decode(pinned, skip_special_tokens=True)
    finally:
        assert stack.stop() == 0, stack.output()[-3000:]
