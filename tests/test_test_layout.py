"""The tests' own layout: a test module imports no other test module and no conftest (which
pytest already loaded: importing it again as `tests.conftest` runs it twice). What tests share
lives in tests/support/ (helpers) and tests/conftest.py (fixtures)."""

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
# Files others are editing still import conftest; each goes when its import moves to support.
PENDING: set[str] = set()


def imported(path: pathlib.Path) -> set[str]:
  """Every module `path` imports, top-level or inside a function."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module)
      names |= {f"{node.module}.{alias.name}" for alias in node.names}
  return names


def forbidden(name: str) -> bool:
  """A test module or conftest, by either name pytest's sys.path gives it."""
  last = name.removeprefix("tests.").split(".")[0]
  return last == "conftest" or (last.startswith("test_") and (TESTS / f"{last}.py").exists())


def offenders() -> dict[str, list[str]]:
  files = sorted(TESTS.glob("test_*.py")) + sorted((TESTS / "support").glob("*.py"))
  found = {path.name: sorted(n for n in imported(path) if forbidden(n)) for path in files}
  return {name: names for name, names in found.items() if names}


def test_no_test_module_imports_another_or_conftest():
  assert set(offenders()) == PENDING, offenders()


def test_the_check_sees_each_kind_of_import(tmp_path):
  for line in ("import conftest", "from tests.conftest import TINY", "from test_sharding import X",
               "def f():\n  import test_server_cli", "from tests import test_load"):
    (tmp_path / "test_x.py").write_text(line + "\n")
    assert any(forbidden(n) for n in imported(tmp_path / "test_x.py")), line
  (tmp_path / "test_x.py").write_text("import support.tiny\nfrom support import server_harness\n")
  assert not any(forbidden(n) for n in imported(tmp_path / "test_x.py"))
