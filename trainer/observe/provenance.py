"""Where a result came from: software versions, machine, checkout and
simulated-host settings, as one JSON-ready dict.

Every results.json gets it (results.results_fields) and so does the
benchmark's results.json. Nothing here imports TensorFlow: versions come
from the installed packages' metadata.
"""

import functools
import importlib.metadata
import json
import os
import pathlib
import platform
import socket
import subprocess

# The benchmark puts its simulated-host settings (JSON) here, so that
# every process it starts records them; unset on loopback and Slurm.
SIMULATED_HOSTS_ENV = "TRAINER_SIMULATED_HOSTS"
_REPO = pathlib.Path(__file__).resolve().parents[2]
_GIT_TIMEOUT_SECS = 10


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    """The first "model name" of /proc/cpuinfo, else platform's guess."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*args: str) -> str | None:
    """`git args` in the checkout this code runs from; None if that fails
    (no git, not a checkout, or no answer in time)."""
    try:
        done = subprocess.run(
            ["git", "-c", f"safe.directory={_REPO}", "-C", str(_REPO),
             *args], capture_output=True, text=True,
            timeout=_GIT_TIMEOUT_SECS)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def _static() -> dict:
    """What does not change while a process runs (asked once)."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "python": platform.python_version(),
        "tensorflow": _version("tensorflow"),
        "numpy": _version("numpy"),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable,
        "host": socket.gethostname(),
        "commit": commit.strip() if commit else None,
        # Changes to tracked files; None where git could not say.
        "dirty": (bool(status.strip()) if status is not None and commit
                  else None),
    }


# The checkout as this process loaded it (at import), not as it is when
# the results are written: the code may change meanwhile.
_static()


def collect() -> dict:
    """This process's provenance: {"python", "tensorflow", "numpy"
    (versions), "cpu_model", "cpu_count" (the machine's), "cpu_usable"
    (this process's affinity), "host", "commit", "dirty" (tracked files
    changed), "simulated_hosts" (the benchmark's settings, or None)}."""
    simulated = os.environ.get(SIMULATED_HOSTS_ENV)
    try:
        simulated = json.loads(simulated) if simulated else None
    except ValueError:
        simulated = {"unparsed": simulated}
    return {**_static(), "simulated_hosts": simulated}


def benchmark(results: list[dict], nodes: list[str] | None = None) -> dict:
    """The benchmark's provenance: its own, plus the hosts its runs'
    leaders reported (from their results' provenance) and, with Slurm,
    the allocation's nodes."""
    own = collect()
    hosts = {r.get("provenance", {}).get("host") for r in results}
    own["run_hosts"] = sorted(h for h in hosts if h)
    if nodes:
        own["slurm_nodes"] = list(nodes)
    return own
