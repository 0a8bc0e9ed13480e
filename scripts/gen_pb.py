"""Generate the Python gRPC stubs (services/pb/*_pb2*.py) from protos/.

    python -m scripts.gen_pb [--mypy]

Run by scripts/gen_protos.sh (`make proto`, with `--mypy` for the .pyi type stubs) and by
setup.py when a wheel is built from a tree that has no stubs yet (`pip install .` on a
clean clone), so an installed Tessera never needs `make`.
"""

from __future__ import annotations

import re
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "services" / "pb"


def generate(mypy: bool = False) -> None:
    """Write the stubs into services/pb, replacing any there; imports made package-relative."""
    from grpc_tools import protoc

    for old in [*OUT.glob("*_pb2*.py"), *OUT.glob("*_pb2*.pyi")]:
        old.unlink()
    outputs = [f"--python_out={OUT}", f"--grpc_python_out={OUT}"]
    if mypy:  # needs mypy-protobuf's protoc-gen-mypy on PATH (the dev extra)
        outputs += [f"--mypy_out=quiet:{OUT}", f"--mypy_grpc_out=quiet:{OUT}"]
    well_known = resources.files("grpc_tools") / "_proto"
    protos = sorted(str(p) for p in PROTOS.glob("*.proto"))
    args = ["protoc", f"-I{PROTOS}", f"-I{well_known}", *outputs, *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTOS}")
    for stub in [*OUT.glob("*_pb2*.py"), *OUT.glob("*_pb2*.pyi")]:
        text = stub.read_text()  # protoc writes `import engine_pb2 as ...`
        stub.write_text(re.sub(r"(?m)^import (\w+_pb2) as ", r"from . import \1 as ", text))


def present() -> bool:
    """Whether every proto has its generated module."""
    return all((OUT / f"{p.stem}_pb2.py").is_file() for p in PROTOS.glob("*.proto"))


if __name__ == "__main__":
    generate(mypy="--mypy" in sys.argv[1:])
