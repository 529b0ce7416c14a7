"""The ssh launcher's check of every host before anything starts.

Each host runs `python -m trainer.remote check` over ssh, all at once,
each bounded by CHECK_SECS, and answers with its facts (one JSON line:
versions, taken ports, missing MNIST files; trainer/remote.py). They are
compared with this machine's: every task must run the same Python,
TensorFlow and trainer code, or the shared-settings check (or worse, a
silent difference in the graph) fires mid-run. Every problem of a host
goes on one line naming the host and the fix.
"""

import concurrent.futures
import json
import subprocess

from trainer.cluster import ssh

CHECK_SECS = 12.0
_VERSIONS = (("python", "Python"), ("tensorflow", "TensorFlow"),
             ("trainer", "trainer"))


def problems(host: ssh.Host, ours: dict, theirs: dict,
             placed: list[ssh.Placement]) -> list[str]:
    """What is wrong with a host whose check answered `theirs` (facts, as
    trainer.remote.facts returns them), given `ours` and the tasks placed
    on it."""
    found = []
    for key, label in _VERSIONS:
        if theirs.get(key) != ours.get(key):
            found.append(f"{label} {theirs.get(key)}, here {ours.get(key)}")
    for p in placed:
        if p.port in theirs.get("ports_taken", ()):
            found.append(f"port {p.port} (for {p.name}) is taken; stop what "
                         "holds it or choose another --base_port")
    workers = [p for p in placed if p.job == "worker"]
    if workers and theirs.get("data_missing") and not theirs.get("download"):
        found.append(f"MNIST missing in {theirs.get('data_dir')} "
                     f"({', '.join(theirs['data_missing'])}); copy it there, "
                     "set --data_dir, or drop --nodownload")
    return found


def _check(host: ssh.Host, argv: list[str]) -> dict | str:
    """The host's facts, or a line saying why there are none."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True,
                              timeout=CHECK_SECS, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"no answer over ssh within {CHECK_SECS:.0f} s"
    said = (done.stderr.strip().splitlines() or [""])[-1]
    if done.returncode == ssh.SSH_FAILED:
        return f"cannot reach it over ssh ({said or 'ssh exited 255'})"
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        said = said or f"exit status {done.returncode}"
        return (f"`python -m trainer.remote check` failed ({said}); is the "
                "checkout at --remote_dir, and --remote_python a Python "
                "with the trainer's packages?")


def check_hosts(placements: list[ssh.Placement], ours: dict, argv_for
                ) -> list[str]:
    """Checks every host of the placements in parallel; returns one line
    per host with a problem (empty: all clear).

    argv_for(host, ports) is the ssh argv of a host's check.
    """
    hosts = list(dict.fromkeys(p.host for p in placements))
    with concurrent.futures.ThreadPoolExecutor(len(hosts)) as pool:
        answers = dict(zip(hosts, pool.map(
            lambda h: _check(h, argv_for(h, [p.port for p in placements
                                             if p.host == h])), hosts)))
    lines = []
    for host in hosts:
        theirs = answers[host]
        found = [theirs] if isinstance(theirs, str) else problems(
            host, ours, theirs, [p for p in placements if p.host == host])
        if found:
            lines.append(f"host {host.destination}: " + "; ".join(found))
    return lines
