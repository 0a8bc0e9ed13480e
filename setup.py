"""Builds the gRPC stubs (services/pb) into the wheel when the tree has none yet, so that
`pip install .` works on a clean clone; everything else is declared in pyproject.toml."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scripts import gen_pb


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        if not gen_pb.present():
            gen_pb.generate()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
