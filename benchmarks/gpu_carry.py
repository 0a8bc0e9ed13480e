"""Build `.gpu/`, what benchmarks/gpu_check.py needs on a GPU machine that reaches no registry.

    python -m benchmarks.gpu_carry        # then, on the GPU machine, from the repository root:
    bash benchmarks/gpu_check.sh          # (carry `.gpu` and `services/pb`)

`.gpu/` (gitignored, well under the 64 MiB a device call carries) holds:
- `wheels/`: the project's pure or CPython-3.12 wheels that such a machine's image (torch,
  triton, transformers, numpy already there) lacks, versions pinned to this venv's, so that the
  generated stubs in services/pb (also carried) meet the protobuf and grpcio they were made for;
- `smollm2-2l.Q4_1.gguf`: the default model's GGUF cut to its first two layers, tensors copied
  as shipped (the whole file, 98 MB, does not fit), for gpu_check's served-GGUF check;
- `smollm2-config/`: the default model's config, tokenizer and chat template, from which
  gpu_check builds a random-weight model of the real size for its throughput section.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import gguf

from services.default_model import DEFAULT_MODEL, gguf_path, resolve_model

CARRY = Path(".gpu")
LAYERS = 2
# Not on the GPU image (or older there than the stubs need); installed there with --no-deps.
WHEELS = (
    "protobuf", "grpcio", "grpcio-health-checking", "grpcio-reflection", "gguf", "platformdirs",
    "starlette", "sse-starlette", "uvicorn", "pydantic", "pydantic-core", "annotated-types",
    "typing-inspection", "llguidance", "prometheus-client", "psutil",
)  # fmt: skip
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja")  # fmt: skip


def download_wheels(out: Path) -> None:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    tags = ["manylinux2014", *(f"manylinux_2_{minor}" for minor in range(17, 40))]
    platform = [arg for tag in tags for arg in ("--platform", f"{tag}_x86_64")]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", *platform, "-d", str(out), *pins],
        check=True,
    )  # fmt: skip


def cut_gguf(source: Path, out: Path, layers: int) -> Path:
    """`source` with only blocks 0..layers-1 (block_count rewritten), tensors as shipped."""
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = layers if name == f"{arch}.block_count" else field.contents()
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    shutil.rmtree(CARRY, ignore_errors=True)
    download_wheels(CARRY / "wheels")
    cut_gguf(gguf_path(), CARRY / f"smollm2-{LAYERS}l.Q4_1.gguf", LAYERS)
    config = CARRY / "smollm2-config"
    config.mkdir()
    for name in CONFIG_FILES:
        shutil.copy(resolve_model(DEFAULT_MODEL) / name, config / name)
    size = sum(f.stat().st_size for f in CARRY.rglob("*") if f.is_file())
    print(f"{CARRY}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
