"""scripts/device_wheels.py, the wheel set scripts/device_check.sh carries to the H200 machine
(which reaches no registry): complete against that machine's package list, with no download.
With .whl/ present (after `bash scripts/device_check.sh --fetch-wheels`) the wheels themselves are
checked; without it (CI), their requirements are read from this environment's copies of the same
versions, so the check still runs and still fails when a dependency is added that the machine
lacks."""

from __future__ import annotations

import importlib.util
import pathlib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("device_wheels", ROOT / "scripts/device_wheels.py")
device_wheels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(device_wheels)


def _pyproject(tmp_path, *deps: str) -> pathlib.Path:
  path = tmp_path / "pyproject.toml"
  path.write_text("[project]\ndependencies = [" + ", ".join(f'"{d}"' for d in deps) + "]\n")
  return path


def test_the_wheel_set_is_complete_for_the_machine():
  assert device_wheels.check(ROOT / ".whl") == []


def test_a_dependency_the_machine_lacks_is_named(tmp_path):
  problems = device_wheels.check(None, _pyproject(tmp_path, "jax>=0.6", "not-on-the-h200>=1"))
  assert any("not-on-the-h200" in p for p in problems)
  assert not any(p.startswith("jax") for p in problems)


def test_a_pin_outside_pyprojects_range_is_named(tmp_path):
  problems = device_wheels.check(None, _pyproject(tmp_path, "gguf>=99"))
  assert any("gguf: carried 0.19.0 outside" in p for p in problems)


def test_markers_for_other_platforms_do_not_count(tmp_path):
  assert device_wheels.check(None, _pyproject(tmp_path, "pywin32; sys_platform == 'win32'")) == []


def _wheel(dest: pathlib.Path, name: str, version: str, tags: str, *requires: str):
  path = dest / f"{name.replace('-', '_')}-{version}-{tags}.whl"
  meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
  with zipfile.ZipFile(path, "w") as zf:
    zf.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\n{meta}")


@pytest.mark.parametrize("tags, requires, expected", [
    ("py3-none-any", ("numpy",), None),
    ("py3-none-any", ("left-behind>=1",), "left-behind"),
    ("py3-none-any", ("pywin32; sys_platform == 'win32'",), None),
    ("cp311-cp311-manylinux2014_x86_64", (), "tags not for cp312"),
    ("cp312-cp312-macosx_11_0_arm64", (), "tags not for cp312"),
])
def test_wheels_requirements_and_tags_are_checked(tmp_path, tags, requires, expected):
  for name, version in device_wheels.CARRY.items():
    _wheel(tmp_path, name, version, tags if name == "gguf" else "py3-none-any",
           *(requires if name == "gguf" else ()))
  problems = device_wheels.check(tmp_path, _pyproject(tmp_path, "gguf"))
  assert (problems == []) if expected is None else any(expected in p for p in problems)


def test_a_missing_or_extra_wheel_is_named(tmp_path):
  for name, version in device_wheels.CARRY.items():
    if name != "llguidance":
      _wheel(tmp_path, name, version, "py3-none-any")
  _wheel(tmp_path, "stray", "1.0", "py3-none-any")
  problems = device_wheels.check(tmp_path, _pyproject(tmp_path, "gguf"))
  assert any("llguidance==1.9.1: no such wheel" in p for p in problems)
  assert any("stray-1.0-py3-none-any.whl: not in CARRY" in p for p in problems)
