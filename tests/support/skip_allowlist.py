"""A pytest plugin: `--allowed-skips FILE` fails a run that skips a test FILE does not allow.

CI passes it (.ci/run), so a test that quietly stops running (a package gone from the test
extra, a tool missing on the machine) fails the run instead of passing as a skip. FILE holds one
allowed skip a line: a test id pattern (fnmatch, e.g. `tests/test_x.py::test_y[*]`), whitespace,
and why it may skip; `#` starts a comment line.
"""

from __future__ import annotations

import fnmatch
import pathlib

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
  parser.addoption("--allowed-skips", metavar="FILE", default=None,
                   help="fail the run when a test is skipped that FILE does not allow")


def pytest_configure(config: pytest.Config) -> None:
  path = config.getoption("--allowed-skips")
  if path:
    config.pluginmanager.register(SkipCheck(read_patterns(path)), "skip_allowlist")


def read_patterns(path: str) -> list[str]:
  """The patterns of an allow-list; a line without its reason is an error."""
  patterns = []
  for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
    if line.strip() and not line.lstrip().startswith("#"):
      pattern, _, why = line.strip().partition(" ")
      if not why.strip():
        raise pytest.UsageError(f"{path}:{number}: {pattern!r} gives no reason it may skip")
      patterns.append(pattern)
  return patterns


class SkipCheck:
  """Notes every skip (of a test, or of a whole module at collection) not on the list."""

  def __init__(self, patterns: list[str]):
    self.patterns = patterns
    self.unallowed: list[tuple[str, str]] = []  # (test id, skip reason)

  def _note(self, report) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):  # xfails report as skipped too.
      return
    # A test id as written matches itself: fnmatch alone reads its [parameters] as a set of
    # characters.
    if not any(report.nodeid == p or fnmatch.fnmatchcase(report.nodeid, p)
               for p in self.patterns):
      why = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
      self.unallowed.append((report.nodeid, str(why)))

  def pytest_collectreport(self, report: pytest.CollectReport) -> None:
    self._note(report)

  def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
    self._note(report)

  def pytest_sessionfinish(self, session: pytest.Session) -> None:
    if self.unallowed and session.exitstatus == pytest.ExitCode.OK:
      session.exitstatus = pytest.ExitCode.TESTS_FAILED

  def pytest_terminal_summary(self, terminalreporter) -> None:
    if self.unallowed:
      terminalreporter.section("skips not on the allow-list (--allowed-skips)", red=True)
      for nodeid, why in self.unallowed:
        terminalreporter.line(f"{nodeid}: {why}")
