"""The wheels scripts/device_check.sh carries to the H200 machine, which reaches no registry: the
project's runtime dependencies its image lacks (scripts/device/h200_packages.txt lists what it
has), and grpcio and protobuf, which it has at versions nobody recorded, older perhaps than our
generated stubs accept (jaxserve/api/proto: grpcio >= 1.85.1, protobuf >= 7.35.1).

  python -m scripts.device_wheels fetch [--dest .whl]   # pip download, here (network)
  python -m scripts.device_wheels check [--dest .whl]   # is the set complete? (no network)

`check` resolves pyproject's runtime dependencies against the image's list plus CARRY, then each
carried package's own requirements (for Python 3.12 on x86-64 Linux) the same way: from the
wheels' METADATA when .whl/ holds them, else from this environment's installed copies of the
same versions (CI has no .whl/ and downloads nothing). With wheels, it also checks one wheel per
pin, cp312/abi3/py3 tags for x86-64 Linux, and their total size against BUDGET_BYTES.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import pathlib
import re
import subprocess
import sys
import zipfile

import tomllib
from packaging.markers import Marker
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent.parent
MACHINE_LIST = ROOT / "scripts" / "device" / "h200_packages.txt"
CARRIED = ("gguf", "llguidance", "grpcio-health-checking", "grpcio-reflection", "grpcio",
           "protobuf")
BUDGET_BYTES = 24 << 20  # Of the 64 MiB a device call carries: the tree and the rest fit beside.
# llguidance 1.9.1 ships for glibc 2.31 only; the image's python 3.12.3 suggests Ubuntu 24.04
# (glibc 2.39), which scripts/device_check.sh prints (ldd --version) before it installs anything.
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython",
          "extra": ""}


def norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def machine_packages(path: pathlib.Path = MACHINE_LIST) -> set[str]:
  lines = path.read_text().splitlines()
  return {norm(line.strip()) for line in lines if line.strip() and not line.startswith("#")}


def carried_pins(pyproject: pathlib.Path = ROOT / "pyproject.toml") -> dict[str, str]:
  """Carried name -> version: the test extra's `==` pins, so CI installs what is carried."""
  extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["test"]
  pins = {norm(r.name): str(r.specifier)[2:] for r in map(Requirement, extra)
          if str(r.specifier).startswith("==")}
  missing = [n for n in CARRIED if norm(n) not in pins]
  if missing:
    raise ValueError(f"pyproject's test extra pins no version of {', '.join(missing)}")
  return {n: pins[norm(n)] for n in CARRIED}


CARRY = carried_pins()  # name -> version


def runtime_requirements(pyproject: pathlib.Path = ROOT / "pyproject.toml") -> list[Requirement]:
  return [Requirement(r) for r in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


def applies(req: Requirement) -> bool:
  """Whether a requirement holds on the machine: its marker true there, and no extra asked."""
  return req.marker is None or Marker(str(req.marker)).evaluate(TARGET)


def wheel_files(dest: pathlib.Path) -> dict[str, pathlib.Path]:
  """Carried name -> its wheel in `dest` (the file name's first field, normalised)."""
  return {norm(w.name.split("-")[0]): w for w in sorted(dest.glob("*.whl"))}


def wheel_requires(wheel: pathlib.Path) -> list[Requirement]:
  with zipfile.ZipFile(wheel) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    text = zf.read(meta).decode()
  return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
          if line.startswith("Requires-Dist:")]


def installed_requires(name: str, version: str) -> tuple[list[Requirement], str | None]:
  """A carried package's requirements read from this environment's copy, and a problem if that
  copy is missing or of another version than the pin."""
  try:
    have = importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return [], f"{name}: no .whl/ and not installed here, so its requirements are unknown"
  reqs = [Requirement(r) for r in importlib.metadata.requires(name) or ()]
  return reqs, None if have == version else f"{name}: installed {have} here, pinned {version}"


def tag_problem(wheel: pathlib.Path) -> str | None:
  """None if the wheel's tags install on CPython 3.12, x86-64 Linux (glibc 2.31 or older)."""
  _, _, py, abi, plat = wheel.stem.rsplit("-", 4)
  py_ok = bool({"cp312", "py3", "py2.py3"} & set(py.split("."))) or abi == "abi3"
  plat_ok = plat == "any" or any(p in PLATFORMS for p in plat.split("."))
  return None if py_ok and plat_ok else f"{wheel.name}: tags not for cp312 x86-64 linux"


def check_wheels(dest: pathlib.Path) -> list[str]:
  files, problems = wheel_files(dest), []
  for name, version in CARRY.items():
    wheel = files.get(norm(name))
    if wheel is None or wheel.name.split("-")[1] != version:
      problems.append(f"{name}=={version}: no such wheel in {dest}")
    elif (p := tag_problem(wheel)) is not None:
      problems.append(p)
  problems += [f"{w.name}: not in CARRY" for n, w in files.items() if n not in map(norm, CARRY)]
  size = sum(w.stat().st_size for w in files.values())
  if size > BUDGET_BYTES:
    problems.append(f"wheels are {size >> 20} MiB, over the {BUDGET_BYTES >> 20} MiB budget")
  return problems


def check(dest: pathlib.Path | None, pyproject: pathlib.Path = ROOT / "pyproject.toml",
          machine: set[str] | None = None) -> list[str]:
  """Every problem that would stop `pip install --no-index --no-deps` of the project plus .whl/
  from running on the machine; [] when the set is complete."""
  machine = machine_packages() if machine is None else machine
  have = machine | {norm(n) for n in CARRY}
  problems = [f"{r}: neither on the machine nor carried" for r in runtime_requirements(pyproject)
              if applies(r) and norm(r.name) not in have]
  problems += [f"{r.name}: carried {CARRY[n]} outside pyproject's {r.specifier}"
               for r in runtime_requirements(pyproject)
               for n in CARRY if norm(n) == norm(r.name) and CARRY[n] not in r.specifier]
  wheels = wheel_files(dest) if dest is not None and dest.is_dir() else {}
  for name, version in CARRY.items():
    if wheels:
      reqs = wheel_requires(wheels[norm(name)]) if norm(name) in wheels else []
    else:
      reqs, problem = installed_requires(name, version)
      problems += [problem] if problem else []
    problems += [f"{name} needs {r}: neither on the machine nor carried" for r in reqs
                 if applies(r) and norm(r.name) not in have]
  return problems + (check_wheels(dest) if wheels else [])


def fetch_command(dest: pathlib.Path) -> list[str]:
  platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
  return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
          "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest),
          *(f"{n}=={v}" for n, v in CARRY.items())]


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("command", choices=("fetch", "check"))
  parser.add_argument("--dest", type=pathlib.Path, default=ROOT / ".whl")
  args = parser.parse_args(argv)
  if args.command == "fetch":
    subprocess.run(fetch_command(args.dest), check=True)
  problems = check(args.dest)
  wheels = wheel_files(args.dest) if args.dest.is_dir() else {}
  for w in wheels.values():
    print(f"  {w.name}  {w.stat().st_size / 2**20:.2f} MiB")
  total = sum(w.stat().st_size for w in wheels.values())
  source = f"{len(wheels)} wheels in {args.dest}, {total / 2**20:.1f} MiB" if wheels else (
      f"no wheels in {args.dest}: requirements read from this environment's copies")
  print("\n".join(f"PROBLEM {p}" for p in problems) or f"wheel set complete ({source})")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
