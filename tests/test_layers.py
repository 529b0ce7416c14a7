"""The package's layers import one way, as each subpackage's docstring
says: learning knows nothing of roles or the cluster, the protocol knows
no roles, nothing in training imports the benchmark."""

import ast
import pathlib

import pytest

from tests import helpers

# Subpackage -> the trainer subpackages it may import (besides itself).
ALLOWED = {
    "common": set(),
    "cluster": {"common"},
    "learning": {"common"},
    "sync": {"common", "learning"},
    "saving": {"common", "learning"},
    "observe": {"common", "cluster", "learning"},
    "roles": {"common", "cluster", "learning", "sync", "saving", "observe"},
}


def trainer_imports(path: pathlib.Path) -> set[str]:
    """The trainer subpackages (or top-level modules) a file imports,
    at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + (
                [f"{node.module}.{a.name}" for a in node.names]
                if node.module == "trainer" else [])
        for name in names:
            parts = name.split(".")
            if parts[0] == "trainer" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_layer_imports_only_those_below_it(package):
    folder = helpers.REPO / "trainer" / package
    files = sorted(folder.rglob("*.py"))
    assert files
    for path in files:
        extra = trainer_imports(path) - ALLOWED[package] - {package}
        assert not extra, f"{path.relative_to(helpers.REPO)} imports {extra}"


def test_nothing_in_training_imports_the_benchmark():
    for package in ALLOWED:
        for path in (helpers.REPO / "trainer" / package).rglob("*.py"):
            assert "bench" not in trainer_imports(path), path
    for command in ("main.py", "launch.py", "flags.py"):
        assert "bench" not in trainer_imports(
            helpers.REPO / "trainer" / command), command
