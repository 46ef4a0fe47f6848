"""scripts/device_wheels.py, the wheel set scripts/device_check.sh carries to the H200 machine
(which reaches no registry): complete against that machine's package list, with no download.
With .whl/ present (after `bash scripts/device_check.sh --fetch-wheels`) the wheels themselves are
checked; without it (CI), their requirements are read from this environment's copies of the same
versions, so the check still runs and still fails when a dependency is added that the machine
lacks."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
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


def test_the_dry_run_passes_and_prints_both_modes():
  """`bash scripts/device_check.sh --dry-run`, as the issue's CPU check asks: the wheel set
  complete (from .whl/ or this environment's copies), every step of --smoke and the full run."""
  env = dict(os.environ, PYTHON=sys.executable)
  out = subprocess.run(["bash", str(ROOT / "scripts/device_check.sh"), "--dry-run"], env=env,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "wheel set complete" in out.stdout
  for step in ("probe", "kernels", "kernel_sweep", "bench_8b_bf16", "bench_8b_int8", "served"):
    assert f"+ [{step}, " in out.stdout


def test_the_summary_keeps_exit_codes_pytest_lines_and_json(tmp_path):
  (tmp_path / "steps.jsonl").write_text('{"step": "a", "rc": 1, "seconds": 3, "limit": 9}\n')
  (tmp_path / "a.log").write_text('noise\n{"run": {"slots": 1}}\n{not json\n'
                                  "==== 2 passed, 1 failed in 3.1s ====\n")
  out = subprocess.run([sys.executable, str(ROOT / "scripts/device/summary.py"), str(tmp_path),
                        "--smoke"], capture_output=True, text=True, check=True)
  step, = json.loads(out.stdout)["steps"]
  assert (step["rc"], step["pytest"], step["json"]) == (1, "2 passed, 1 failed in 3.1s",
                                                        [{"run": {"slots": 1}}])


def test_ci_installs_the_carried_versions_and_the_stub_generator_it_was_made_with():
  """A release upstream (grpcio 1.85.4, 2026-12) once turned CI red: it installed the newest
  grpcio and grpcio-tools, not what is carried nor what generated the committed stubs."""
  extra = device_wheels.tomllib.loads((ROOT / "pyproject.toml").read_text())
  pins = {device_wheels.norm(r.name): str(r.specifier) for r in map(
      device_wheels.Requirement, extra["project"]["optional-dependencies"]["test"])}
  assert pins["grpcio-tools"].startswith("==")
  for name, version in device_wheels.carried_pins().items():
    assert pins[device_wheels.norm(name)] == f"=={version}"
