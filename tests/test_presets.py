"""The benchmark presets in docs/presets/ parse with the real benchmark flags.

Each preset is an absl flagfile for `python -m trainer.benchmark
--flagfile=docs/presets/<name>.flags`. One subprocess imports
trainer.benchmark (which defines every flag the command takes) and parses
each preset with absl, so a renamed flag, a removed enum value or a bad
number fails here rather than an hour into a run. Nothing is run.
"""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRESETS = ROOT / "docs" / "presets"
PRESET_FILES = sorted(PRESETS.glob("*.flags"))

# Runs in a fresh interpreter: absl's FLAGS is process-wide, and importing
# the benchmark must not define flags in the test process.
_PARSE = r"""
import json, sys
from absl import flags
import trainer.benchmark  # defines the benchmark's and the trainer's flags

FLAGS = flags.FLAGS
results = {}
for path in sys.argv[1:]:
    FLAGS.unparse_flags()
    try:
        rest = FLAGS(["benchmark", "--flagfile=" + path])
    except flags.Error as e:
        results[path] = {"error": f"{type(e).__name__}: {e}"}
        continue
    results[path] = {
        "leftover": rest[1:],
        "present": sorted(name for name in FLAGS
                          if FLAGS[name].present),
        "values": {name: FLAGS[name].serialize() for name in FLAGS
                   if FLAGS[name].present},
    }
print(json.dumps(results))
"""


def _flag_lines(path: pathlib.Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]


@pytest.fixture(scope="module")
def parsed() -> dict:
    if not PRESET_FILES:
        return {}
    proc = subprocess.run(
        [sys.executable, "-c", _PARSE] + [str(p) for p in PRESET_FILES],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_there_are_presets():
    assert PRESET_FILES, f"no *.flags in {PRESETS}"


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: p.name)
def test_preset_starts_with_a_comment_and_has_one_flag_per_line(path):
    lines = path.read_text().splitlines()
    assert lines and lines[0].startswith("# "), (
        f"{path.name}: the first line should say what it reproduces")
    for line in _flag_lines(path):
        assert line.startswith("--") and " " not in line, (
            f"{path.name}: one --flag=value per line, got {line!r}")


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: p.name)
def test_preset_parses_with_the_benchmark_flags(parsed, path):
    result = parsed[str(path)]
    assert "error" not in result, f"{path.name}: {result.get('error')}"
    assert result["leftover"] == [], (
        f"{path.name}: not flags: {result['leftover']}")
    named = {line[2:].split("=", 1)[0] for line in _flag_lines(path)}
    named = {n[2:] if n.startswith("no") and n[2:] in result["present"]
             else n for n in named}
    assert named <= set(result["present"]), (
        f"{path.name}: not set: {sorted(named - set(result['present']))}")
    # Every preset reproduces a measurement on simulated hosts: directly,
    # or (--hosts=slurm) on simulated Slurm nodes, which its comment names.
    assert result["values"].get("hosts") in ("--hosts=simulated",
                                             "--hosts=slurm")
    if result["values"]["hosts"] == "--hosts=slurm":
        assert "python -m tests.slurm_nodes" in path.read_text()


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: p.name)
def test_preset_is_named_in_the_docs(path):
    docs = (ROOT / "docs" / "simulated-hosts.md").read_text()
    assert f"presets/{path.name}" in docs, (
        f"{path.name} is not mentioned in docs/simulated-hosts.md")
