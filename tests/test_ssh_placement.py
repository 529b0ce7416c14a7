"""The ssh launcher's pure parts: --ssh_hosts, placement, the ssh command,
the check's verdicts, and trainer.remote's facts. No ssh, no cluster."""

import shlex
import socket
import subprocess
import sys
import time

import pytest

from tests import helpers
from trainer import remote
from trainer.cluster import preflight
from trainer.cluster import ssh
from trainer.common.errors import UserError


def test_hosts_parse_with_users_addresses_and_comments():
    hosts = ssh.parse_hosts("ml@a, b=10.0.0.2\n# spare\nc  # the last\n")
    assert hosts == [ssh.Host("ml@a", "a"), ssh.Host("b", "10.0.0.2"),
                     ssh.Host("c", "c")]
    assert [h.name for h in hosts] == ["a", "b", "c"]


@pytest.mark.parametrize("text, says", [
    ("", "--ssh_hosts is empty"),
    (" , # nothing\n", "--ssh_hosts is empty"),
    ("a,b,a", "a is given twice"),
    ("a=", "bad entry 'a='"),
])
def test_bad_hosts_are_one_clear_error(text, says):
    with pytest.raises(UserError, match=says):
        ssh.parse_hosts(text)


def test_ps_then_workers_go_on_the_hosts_in_turn():
    hosts = ssh.parse_hosts("a,b,c")
    placed = ssh.place(hosts, 1, 2, 2222)
    assert [(p.name, p.address) for p in placed] == [
        ("ps0", "a:2222"), ("worker0", "b:2222"), ("worker1", "c:2222")]
    placed = ssh.place(hosts[:2], 2, 3, 9000)
    assert [(p.name, p.address) for p in placed] == [
        ("ps0", "a:9000"), ("ps1", "b:9000"), ("worker0", "a:9001"),
        ("worker1", "b:9001"), ("worker2", "a:9002")]


def test_the_remote_command_execs_in_the_remote_folder():
    argv = ssh.ssh_argv(ssh.Host("ml@a", "a"), ["/opt/py 3/python", "-m",
                                                "trainer.remote", "run"],
                        2200, "-i key -o User=x", "/srv/my checkout")
    assert argv[0] == "ssh" and "BatchMode=yes" in argv
    assert argv[argv.index("-p") + 1] == "2200"
    assert argv[-2:] == ["ml@a", "cd '/srv/my checkout' && exec "
                         "'/opt/py 3/python' -m trainer.remote run"]
    assert argv[-6:-2] == ["-i", "key", "-o", "User=x"]
    # The remote shell splits the command back into the same words.
    assert shlex.split(argv[-1])[4:] == ["/opt/py 3/python", "-m",
                                         "trainer.remote", "run"]


OURS = {"python": "3.11.7", "tensorflow": "2.21.0", "trainer": "0.1.0 (x)"}


def test_a_host_like_ours_has_no_problem():
    placed = ssh.place(ssh.parse_hosts("a"), 1, 1, 2222)
    theirs = {**OURS, "ports_taken": [], "data_missing": [],
              "download": False}
    assert preflight.problems(placed[0].host, OURS, theirs, placed) == []


def test_every_problem_of_a_host_is_named():
    placed = ssh.place(ssh.parse_hosts("a"), 1, 1, 2222)
    theirs = {"python": "3.11.2", "tensorflow": "2.21.0",
              "trainer": "0.1.0 (y)", "ports_taken": [2223],
              "data_dir": "/d", "data_missing": ["t10k-labels-idx1-ubyte.gz"],
              "download": False}
    found = preflight.problems(placed[0].host, OURS, theirs, placed)
    assert found == [
        "Python 3.11.2, here 3.11.7", "trainer 0.1.0 (y), here 0.1.0 (x)",
        "port 2223 (for worker0) is taken; stop what holds it or choose "
        "another --base_port",
        "MNIST missing in /d (t10k-labels-idx1-ubyte.gz); copy it there, "
        "set --data_dir, or drop --nodownload"]
    # Missing data is fine where it may be downloaded, or where no worker is.
    assert len(preflight.problems(placed[0].host, OURS,
                                  {**theirs, "download": True}, placed)) == 3
    assert len(preflight.problems(placed[0].host, OURS, theirs,
                                  placed[:1])) == 2


def test_remote_facts_name_versions_ports_and_data(tmp_path):
    import socket
    holder = socket.create_server(("", 0))
    port = holder.getsockname()[1]
    try:
        facts = remote.facts([port], str(tmp_path), download=False)
    finally:
        holder.close()
    assert facts["ports_taken"] == [port]
    assert len(facts["data_missing"]) == 4
    assert facts["tensorflow"] and facts["python"].count(".") == 2
    assert facts["trainer"] == remote.trainer_version()


def test_a_hang_up_while_the_port_is_taken_starts_nothing(tmp_path):
    """`trainer.remote run` waits for its port (a run before a lost
    connection may still hold it); the launcher hanging up meanwhile ends
    it with 143 at once (before, it waited out the port, PORT_WAIT_SECS,
    then started a task that outlived the launcher)."""
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.Popen(
            [sys.executable, "-m", "trainer.remote", "run", f"--port={port}",
             "--", "--job_name=ps", f"--logdir={tmp_path}"],
            stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=helpers.REPO, env=helpers.python_env())
        try:
            time.sleep(2)
            run.stdin.close()
            assert run.wait(timeout=20) == 143
        finally:
            run.kill()
            run.wait()
    assert f"port {port} is taken" in run.stderr.read()


# `trainer.remote run` with its task a stand-in that says it is up, then
# lives until a signal ends it (or, given "deaf", ignores SIGTERM).
_STAND_IN = """
import sys
from trainer import remote
from trainer.common import processes
remote.STOP_GRACE_SECS = 1.0
start = processes.Child.start
TASK = (
    "import signal, sys, time\\n"
    "if sys.argv[1] == 'deaf':\\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
    "print('up', flush=True)\\n"
    "time.sleep(60)\\n")
processes.Child.start = lambda name, argv, *a, **kw: start(
    name, [sys.executable, "-c", TASK, argv[-1]], *a,
    **{**kw, "stdout": None})
sys.exit(remote.main(["run", "--", sys.argv[1]]))
"""


@pytest.mark.parametrize("task, status", [("hears", 143), ("deaf", 137)])
def test_a_hang_up_stops_the_task_with_sigterm_then_sigkill(task, status):
    """The launcher gone (stdin closed), `run` sends its task SIGTERM,
    and SIGKILL STOP_GRACE_SECS later if it is still running; `run`
    exits with the task's status."""
    run = subprocess.Popen(
        [sys.executable, "-c", _STAND_IN, task], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=helpers.REPO, env=helpers.python_env())
    try:
        assert run.stdout.readline() == "up\n"
        started = time.monotonic()
        run.stdin.close()
        assert run.wait(timeout=20) == status
        waited = time.monotonic() - started
        assert (waited >= 1.0) == (task == "deaf"), waited
    finally:
        run.kill()
        run.wait()
    assert ("still alive 1 s after SIGTERM" in run.stderr.read()) == (
        task == "deaf")


def test_an_ssh_task_is_made_with_its_host():
    """ssh.start makes the task with its ssh destination, which its report
    names (here `true` stands in for ssh)."""
    placement = ssh.Placement("worker", 1, ssh.Host("ml@b", "10.0.0.2"), 2223)
    task = ssh.start(placement, ["true"])
    assert task.host_name == "ml@b"
    assert task.poll(block=True) == 0 and not task.unreachable
    task.join_relay(timeout=5)
    assert task.report()["host"] == "ml@b"
