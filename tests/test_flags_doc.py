"""docs/flags.md against the flags the commands define: every flag a
command defines has a row in its section, every row names a flag the
command has, and the documented default is the flag's default (the code
is the truth). And TrainConfig's fields against the trainer's flags of
the same name: the same default, so the two cannot drift.

The trainer's flags are read in this process (trainer/flags.py imports
no TensorFlow); those of launch, benchmark and soak in a process per
command, since they define flags of the same name (--out, --num_workers)
with other defaults."""

import dataclasses
import json
import pathlib
import re
import subprocess
import sys

import pytest

from trainer import flags as trainer_flags
from trainer.common import config

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "flags.md"
COMMANDS = ("main", "launch", "benchmark", "soak")

# Defaults the code computes where the flag is read or defined, which the
# docs write as what they come to: command -> flag -> (the documented
# text, the flag's default in the code).
DERIVED = {
    "main": {
        "task_index": ("0", None),         # trainer/cluster/spec.resolve
        "epochs": (str(config.DEFAULT_EPOCHS), None),
        "logdir": ("runs/<model>", None),  # trainer/flags.py
    },
    "launch": {
        "remote_dir": ("this checkout", str(ROOT)),
        "remote_python": ("this Python", sys.executable),
    },
    "benchmark": {
        "seeds": ("--seed", []),
        "ps_cpu": ("--host_cpu", None),
        "out": ("bench/<model>-<time>", None),
    },
    "soak": {
        "out": ("soak/<time>", None),
    },
}

# A command's flags and their defaults, printed by a process that imports
# it: {"own": the flags it defines itself (with --num_workers and
# --isolate, which trainer/flags.py defines for it), "defaults": every
# flag's default}.
_DUMP = """
import json, sys
from absl import flags
from trainer import flags as trainer_flags
import trainer.{command}
F = flags.FLAGS
shared = set(trainer_flags.trainer_flag_names())
own = [f.name for module in ("trainer.{command}", "trainer.flags")
       for f in F.get_flags_for_module(module) if f.name not in shared]
json.dump({{"own": own, "defaults": {{n: F[n].default for n in F}}}},
          sys.stdout, default=str)
"""


def sections() -> dict[str, list[tuple[str, str]]]:
    """command -> (flag, documented default) of each row of the tables
    under its heading ("## `python -m trainer.<command>` ...")."""
    found: dict[str, list[tuple[str, str]]] = {}
    rows = None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"## `python -m trainer\.(\w+)`", line)
        if heading:
            rows = found.setdefault(heading[1], [])
        elif line.startswith("## "):
            rows = None
        elif rows is not None and line.startswith("| `--"):
            cells = [c.strip() for c in line.split("|")[1:3]]
            name = re.fullmatch(r"`--(?:\[no\])?(\w+)`", cells[0])
            assert name, f"docs/flags.md: unreadable flag cell {cells[0]}"
            rows.append((name[1], cells[1].strip("`")))
    return found


def command_flags(command: str) -> tuple[set[str], dict]:
    """(the flags `command` defines itself, every flag's default)."""
    if command == "main":
        names = trainer_flags.trainer_flag_names()
        return set(names), {n: trainer_flags.FLAGS[n].default
                            for n in names}
    out = subprocess.run(
        [sys.executable, "-c", _DUMP.format(command=command)], cwd=ROOT,
        capture_output=True, text=True, timeout=120, check=True).stdout
    dump = json.loads(out)
    return set(dump["own"]), dump["defaults"]


def documented(default) -> str | None:
    """A default as docs/flags.md writes it: on/off, a number as Python
    prints it, a list joined by commas, blank for None; None for a
    number (compared as a number)."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, (int, float)):
        return None
    if isinstance(default, list):
        return ",".join(default)
    return "" if default is None else default


def mismatch(name: str, text: str, default, derived: dict) -> str | None:
    """Why the documented `text` is not the flag's `default`, or None."""
    if name in derived:
        doc_text, code_default = derived[name]
        if default != code_default:
            return (f"--{name}: the flag's default is {default!r}, not the "
                    f"{code_default!r} this test expects it to compute")
        if text != doc_text:
            return (f"--{name}: documented {text!r}, not {doc_text!r}, "
                    f"what its default {default!r} comes to")
        return None
    if documented(default) is None:
        try:
            ok = float(text) == default
        except ValueError:
            ok = False
    else:
        ok = text == documented(default) or (
            default is None and text.lower() == "none")
    if ok:
        return None
    return f"--{name}: documented {text!r}, the flag's default is " \
           f"{default!r}"


@pytest.fixture(scope="module")
def docs():
    return sections()


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_a_section(docs, command):
    assert docs.get(command), f"docs/flags.md has no rows for {command}"


@pytest.mark.parametrize("command", COMMANDS)
def test_documented_defaults_are_the_flags(docs, command):
    own, defaults = command_flags(command)
    rows = docs.get(command, [])
    names = [name for name, _ in rows]
    problems = [f"--{n} is listed twice" for n in set(names)
                if names.count(n) > 1]
    problems += [f"--{n} is documented but {command} has no such flag"
                 for n in names if n not in defaults]
    problems += [f"--{n} is a flag of {command} but not documented"
                 for n in sorted(own - set(names))]
    if command == "main":
        problems += [f"--{n} is documented but not a trainer flag"
                     for n in sorted(set(names) - own)]
    problems += [mismatch(n, text, defaults[n], DERIVED.get(command, {}))
                 for n, text in rows if n in defaults]
    problems = [p for p in problems if p]
    assert not problems, (f"docs/flags.md, {command}:\n"
                          + "\n".join(problems))


def test_derived_defaults_are_still_documented(docs):
    """Every DERIVED entry names a documented flag: none is left over."""
    for command, derived in DERIVED.items():
        names = {name for name, _ in docs.get(command, [])}
        assert set(derived) <= names, (command, set(derived) - names)


def config_defaults() -> dict:
    return {f.name: f.default for f in dataclasses.fields(config.TrainConfig)
            if f.default is not dataclasses.MISSING}


def test_train_config_and_the_flags_have_the_same_defaults():
    flag_values = trainer_flags.FLAGS
    names = set(trainer_flags.trainer_flag_names())
    fields = config_defaults()
    differ = [f"{n}: TrainConfig {fields[n]!r}, flag "
              f"{flag_values[n].default!r}" for n in sorted(names)
              if n in fields and fields[n] != flag_values[n].default]
    assert not differ, "\n".join(differ)
    # Every setting of the run is a flag of its name.
    no_flag = {f.name for f in dataclasses.fields(config.TrainConfig)} - names
    assert not no_flag, f"TrainConfig fields without a flag: {no_flag}"
