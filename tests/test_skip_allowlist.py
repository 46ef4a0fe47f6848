"""support/skip_allowlist.py, the `--allowed-skips FILE` check CI runs with, on a throwaway test
file in its own pytest process: a skip not on the list fails the run, one on it does not."""

import os
import pathlib
import subprocess
import sys

import pytest

SUPPORT_ROOT = pathlib.Path(__file__).resolve().parent  # Where `support` imports from.
TINY_SUITE = """
import pytest

def test_runs():
  pass

def test_skips():
  pytest.skip("no frobnicator here")
"""


def run_pytest(folder: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
  path = os.pathsep.join([str(SUPPORT_ROOT), os.environ.get("PYTHONPATH", "")])
  env = {**os.environ, "PYTHONPATH": path}
  (folder / "pytest.ini").write_text("[pytest]\n")  # Its own rootdir: not this suite's conftest.
  return subprocess.run([sys.executable, "-m", "pytest", "-p", "support.skip_allowlist",
                         "-p", "no:cacheprovider", "-rs", *args], cwd=folder, env=env,
                        capture_output=True, text=True, timeout=120)


@pytest.fixture
def suite(tmp_path):
  (tmp_path / "test_tiny.py").write_text(TINY_SUITE)
  return tmp_path


def test_a_skip_not_on_the_list_fails_the_run_and_is_named(suite):
  (suite / "allowed.txt").write_text("# nothing\ntest_tiny.py::test_other  another reason\n")
  run = run_pytest(suite, "--allowed-skips", "allowed.txt", "test_tiny.py")
  assert run.returncode == 1, run.stdout
  assert "skips not on the allow-list" in run.stdout
  assert "test_tiny.py::test_skips: Skipped: no frobnicator here" in run.stdout


def test_a_skip_on_the_list_passes(suite):
  (suite / "allowed.txt").write_text("test_tiny.py::test_sk*  the machine has no frobnicator\n")
  run = run_pytest(suite, "--allowed-skips", "allowed.txt", "test_tiny.py")
  assert run.returncode == 0, run.stdout
  assert "skips not on the allow-list" not in run.stdout


def test_a_parametrized_test_id_on_the_list_matches_itself(suite):
  """`[...]` in a test id is its parameters, not an fnmatch set of characters."""
  (suite / "test_params.py").write_text(
      "import pytest\n\n@pytest.mark.parametrize('x', ['A-1', 'B'])\n"
      "def test_p(x):\n  if x == 'A-1':\n    pytest.skip('not for A')\n")
  (suite / "allowed.txt").write_text("test_params.py::test_p[A-1]  A is not supported\n")
  run = run_pytest(suite, "--allowed-skips", "allowed.txt", "test_params.py")
  assert run.returncode == 0, run.stdout
  assert "skips not on the allow-list" not in run.stdout


def test_without_the_option_a_skip_passes_as_before(suite):
  run = run_pytest(suite, "test_tiny.py")
  assert run.returncode == 0, run.stdout


def test_a_module_skipped_at_collection_counts(suite):
  (suite / "test_gone.py").write_text("import pytest\npytest.importorskip('no_such_package_x')\n")
  (suite / "allowed.txt").write_text("test_tiny.py::test_skips  the machine has no frobnicator\n")
  run = run_pytest(suite, "--allowed-skips", "allowed.txt")
  assert run.returncode == 1, run.stdout
  assert "test_gone.py: " in run.stdout


def test_no_tests_stays_exit_5_and_a_line_without_a_reason_is_refused(suite):
  (suite / "allowed.txt").write_text("test_tiny.py::test_skips\n")
  run = run_pytest(suite, "--allowed-skips", "allowed.txt", "test_tiny.py")
  assert run.returncode == 4 and "gives no reason" in run.stderr, run.stderr
  (suite / "allowed.txt").write_text("")
  assert run_pytest(suite, "--allowed-skips", "allowed.txt", "-k",
                    "nothing_matches").returncode == 5
