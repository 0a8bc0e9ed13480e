"""services/wire.py is generated from protos/ and stays current: a message edited without
`make proto` fails here."""

from pathlib import Path

from scripts import gen_wire_types

ROOT = Path(__file__).resolve().parents[2]


def test_the_generated_wire_types_are_current() -> None:
    assert gen_wire_types.main(["--check"]) == 0, "run: python -m scripts.gen_wire_types"


def test_no_code_is_built_with_exec() -> None:
    """The converters are plain generated source: no exec anywhere in the services."""
    dirs = ["services", "gateway", "scheduler_service", "worker_service", "tessera"]
    hits = [
        f"{path.relative_to(ROOT)}:{n}"
        for d in dirs
        for path in (ROOT / d).rglob("*.py")
        if "/pb/" not in str(path)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "exec(" in line
    ]
    assert hits == []
