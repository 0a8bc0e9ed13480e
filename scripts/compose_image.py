"""Building Tessera's image for the compose check: the Dockerfile with this host's pip settings.

pip inside the build needs the host's settings (index, find-links, constraints, certificate):
they go in as the build secret `pipconf` (a pip.conf, never stored in the image), and every host
path they name is mounted read-only under HOST_MOUNT for the build (`podman build -v`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
IMAGE = "tessera:latest"  # the image compose.yaml names
LOCAL_BASE = "localhost/debian:bookworm"  # a debootstrap base, used when present
HOST_MOUNT = "/mnt/host"  # where the build sees the host paths pip's settings name


def run(*argv: str, check: bool = True, timeout: float = 900, **kw: Any) -> str:
    """stdout of `argv` (stderr passes through); CalledProcessError when check and rc != 0."""
    done = subprocess.run(
        argv, cwd=REPO, stdout=subprocess.PIPE, text=True, timeout=timeout, check=check, **kw
    )
    return done.stdout


def pip_settings() -> dict[str, dict[str, str]]:
    """This host's effective pip settings by section; PIP_* variables override the files."""
    listing = run(sys.executable, "-m", "pip", "config", "list")
    files: dict[str, dict[str, str]] = {}
    env: dict[str, str] = {}
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if sep and key:
            target = env if section == ":env:" else files.setdefault(section, {})
            target[key] = ast.literal_eval(value)
    files.setdefault("global", {}).update(env)
    return files


def mount_host_paths(
    settings: dict[str, dict[str, str]],
) -> tuple[dict[str, dict[str, str]], list[str]]:
    """`settings` with every existing host path (plain or file://) moved under HOST_MOUNT, and
    the host paths the build must mount there read-only. A local index is mounted with its
    parent folder: its pages link to files beside it (`../../files/...`)."""
    mounts: list[str] = []

    def moved(key: str, token: str) -> str:
        scheme = "file://" if token.startswith("file://") else ""
        path = token.removeprefix(scheme)
        if not path.startswith("/") or not Path(path).exists():
            return token
        mounts.append(str(Path(path).parent) if key.endswith("index-url") else path)
        return f"{scheme}{HOST_MOUNT}{path}"

    rewritten = {
        section: {k: " ".join(moved(k, t) for t in v.split()) for k, v in values.items()}
        for section, values in settings.items()
    }
    return rewritten, sorted(set(mounts))


def pip_conf(settings: dict[str, dict[str, str]]) -> str:
    """The text of a pip.conf holding `settings`."""
    blocks = [
        f"[{s}]\n" + "".join(f"{k} = {v}\n" for k, v in kv.items()) for s, kv in settings.items()
    ]
    return "\n".join(blocks)


def build_image(podman: str, base_image: str | None) -> float:
    """Build IMAGE from the Dockerfile with the host's pip settings; returns the seconds taken."""
    settings, mounts = mount_host_paths(pip_settings())
    volumes = [a for p in mounts for a in ("-v", f"{p}:{HOST_MOUNT}{p}:ro")]  # podman only
    base = ["--build-arg", "TORCH_VARIANT=cpu"]  # the CPU wheel the host's install uses
    base += ["--build-arg", f"BASE_IMAGE={base_image}"] if base_image else []
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "pip.conf"
        conf.write_text(pip_conf(settings))
        start = time.monotonic()
        argv = [podman, "build", "-t", IMAGE, "--secret", f"id=pipconf,src={conf}", *volumes, *base]
        subprocess.run([*argv, "."], cwd=REPO, stdout=sys.stderr, check=True)  # shows progress
    return time.monotonic() - start


def image_exists(podman: str, image: str) -> bool:
    return subprocess.run([podman, "image", "exists", image], check=False).returncode == 0


def image_mb(podman: str, image: str = IMAGE) -> int:
    return int(run(podman, "image", "inspect", "--format", "{{.Size}}", image)) // 2**20
