"""The process supervisor (trainer/common/processes.py) and the progress
line's parser, on short-lived real processes."""

import logging as std_logging
import re
import signal
import subprocess
import sys
import time
import types

from absl import logging as absl_logging
import pytest

from trainer.common import processes
from trainer.common.config import TrainConfig
from trainer.observe import progress
from trainer.observe import progress_line


def python(code: str, **kwargs) -> processes.Child:
    """`python -c code` as a Child in a session of its own."""
    return processes.Child.start("child", [sys.executable, "-c", code],
                                 processes.child_env(), **kwargs)


@pytest.fixture
def started():
    """Children a test starts; whatever is left is killed at the end."""
    children = []
    yield children
    processes.stop_all(children, grace_secs=0)


def test_child_env_drops_tf_config_and_unbuffers(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{}")
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    env = processes.child_env(EXTRA="1")
    assert "TF_CONFIG" not in env
    assert env["PYTHONUNBUFFERED"] == "1" and env["EXTRA"] == "1"
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "3"
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")  # the caller's wins
    assert processes.child_env()["TF_CPP_MIN_LOG_LEVEL"] == "0"


def test_output_is_relayed_line_by_line_with_a_prefix(started, capfdbinary):
    child = python("print('one'); print('noise'); print('two')",
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    started.append(child)
    child.relay(processes.echo_lines("ps0", skip=re.compile("noise")))
    assert child.poll(block=True) == 0
    child.join_relay(timeout=10)
    assert capfdbinary.readouterr().out == b"[ps0] one\n[ps0] two\n"
    assert child.peak_rss_mb > 0


def test_stop_all_kills_what_ignores_sigterm_after_the_grace(started):
    child = python("import signal, time; signal.signal(signal.SIGTERM, "
                   "signal.SIG_IGN); print('ready', flush=True); "
                   "time.sleep(60)", stdout=subprocess.PIPE, text=True)
    started.append(child)
    assert child.process.stdout.readline() == "ready\n"
    begin = time.monotonic()
    processes.stop_all([child], grace_secs=0.5)
    assert child.poll() == -signal.SIGKILL
    assert 0.5 <= time.monotonic() - begin < 5


def test_stop_all_signals_the_whole_group_of_a_child(started):
    # The child's own child would outlive a signal to the child's pid only.
    child = python("import subprocess, sys, time; subprocess.Popen("
                   "[sys.executable, '-c', 'import time; time.sleep(60)']);"
                   " print('ready', flush=True); time.sleep(60)",
                   stdout=subprocess.PIPE, text=True)
    started.append(child)
    assert child.process.stdout.readline() == "ready\n"
    processes.stop_all([child], grace_secs=5)
    assert child.poll() == -signal.SIGTERM
    deadline = time.monotonic() + 10  # init reaps the orphan meanwhile
    while subprocess.run(["pgrep", "-g", str(child.pid)],
                         capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "the child's child survived"
        time.sleep(0.1)


def test_one_failure_stops_the_others(started):
    failing = python("raise SystemExit(3)")
    waiting = python("import time; time.sleep(60)")
    started += [failing, waiting]
    announced = []
    begin = time.monotonic()
    ending = processes.supervise([waiting, failing], grace_secs=5,
                                 announce=announced.append)
    assert ending.failed is failing and announced == [ending]
    assert failing.poll() == 3 and waiting.poll() == -signal.SIGTERM
    assert time.monotonic() - begin < 15


def test_supervise_gives_up_when_told(started):
    waiting = python("import time; time.sleep(60)")
    started.append(waiting)
    ending = processes.supervise([waiting], grace_secs=5,
                                 give_up=lambda: "enough")
    assert ending.reason == "enough" and ending.failed is None
    assert waiting.poll() == -signal.SIGTERM


def test_supervise_returns_none_when_all_exit_0(started):
    started += [python("pass"), python("pass")]
    assert processes.supervise(started, grace_secs=5) is None
    assert [c.poll() for c in started] == [0, 0]


def written_progress_line(caplog, monkeypatch) -> str:
    """The line the real writer logs, formatted as absl prints it and
    prefixed as the launcher relays the chief's output. The clock is
    fixed: 50 steps in exactly 2 s, however slow this machine is now."""
    monkeypatch.setattr(progress, "time",
                        types.SimpleNamespace(monotonic=lambda: 1002.0))
    interval = progress._Interval(1000.0)
    interval.add(50, (3200, 3200 * 0.25, 3200 * 0.9375))
    with caplog.at_level(std_logging.INFO):
        progress._log(TrainConfig(logdir="x"), None, 150, 1000, interval, 7,
                      [40, 43, 45, 0])
    monkeypatch.undo()
    record = caplog.records[-1]
    return "[worker0] " + absl_logging.PythonFormatter().format(record)


def test_the_progress_line_parses_back(caplog, monkeypatch):
    figures = progress_line.parse_progress_line(
        written_progress_line(caplog, monkeypatch))
    assert figures["step"] == 150 and figures["train_steps"] == 1000
    assert figures["loss"] == pytest.approx(0.25)
    assert figures["train_accuracy"] == pytest.approx(0.9375)
    assert figures["dropped_gradients"] == 7
    assert figures["slices"] == [40, 43, 45, 0]
    assert figures["images_per_sec"] == pytest.approx(1600, rel=0.1)
    assert figures["step_ms"] == pytest.approx(40, rel=0.1)
    hours, minutes, secs = (int(x) for x in figures["eta"].split(":"))
    assert 3600 * hours + 60 * minutes + secs == pytest.approx(
        850 * figures["step_ms"] / 1000, abs=1)


@pytest.mark.parametrize("line", [
    "step 1000: test accuracy 97.10%  test loss 0.0950  (0.4 s)",
    "first step done in 1.2 s (waiting for the workers, warming up)",
    ""])
def test_other_lines_are_not_progress(line):
    assert progress_line.parse_progress_line(line) is None


class _FailedTask:
    """A launcher task that exited with status 1 (tasks.Restarts reads
    its job, index, name and status)."""

    def __init__(self, name, unreachable=False, status=1):
        self.name, self.status = name, status
        self.job = name.rstrip("0123456789")
        self.index = int(name[len(self.job):])
        self.unreachable = unreachable

    def poll(self):
        return self.status


def test_with_mirrors_the_launcher_goes_on_without_a_ps_but_ps_0():
    from trainer.cluster import tasks
    started = []
    restart = tasks.Restarts(0, lambda job, i: started.append((job, i)),
                             num_workers=2, ps_mirrors=True)
    assert restart(_FailedTask("ps1"), []) is True
    assert restart(_FailedTask("ps0"), []) is False
    assert started == []
    without = tasks.Restarts(0, lambda job, i: None, num_workers=2)
    assert without(_FailedTask("ps1"), []) is False
    again = tasks.Restarts(0, lambda job, i: started.append((job, i)) or job,
                           num_workers=2, ps_allowed=1, ps_mirrors=True)
    assert again(_FailedTask("ps1"), []) is True
    assert started == [("ps", 1)]


def test_a_worker_that_fails_after_the_runs_end_is_not_started_again():
    """Once every ps task exited 0 (the chief told them the run is over),
    a failed worker is left alone: started again, it would wait for ps
    tasks that are gone. Before that it is started again as usual."""
    from trainer.cluster import tasks
    started = []
    restart = tasks.Restarts(1, lambda job, i: started.append((job, i)),
                             num_workers=2)
    running = [_FailedTask("ps0", status=None)]
    ended = [_FailedTask("ps0", status=1), _FailedTask("ps0", status=0)]
    assert restart(_FailedTask("worker1"), ended) is True
    assert started == []
    assert restart(_FailedTask("worker1"), running) is True
    assert started == [("worker", 1)]


def test_a_worker_whose_host_is_away_is_started_again_without_a_restart():
    """An unreachable worker (ssh could not reach its host) is started
    again each time without using up --worker_restarts; Restarts keeps it
    among `away` until it fails for a reason of its own."""
    from trainer.cluster import tasks
    started = []
    restart = tasks.Restarts(0, lambda job, i: started.append((job, i)),
                             num_workers=3)
    for _ in range(3):
        assert restart(_FailedTask("worker2", unreachable=True), [])
    assert restart.away == {2} and started == [("worker", 2)] * 3
    assert restart(_FailedTask("worker2"), []) is True   # left behind
    assert restart.away == set() and len(started) == 3


def test_a_second_signal_does_not_cut_the_cleanup_short(tmp_path):
    """The nemesis left its simulated hosts behind when SIGTERM came twice
    (to `timeout` and to the command it forwards it to): the second one
    interrupted the cleanup that the first one started."""
    done = tmp_path / "cleaned"
    code = (
        "import time, pathlib\n"
        "from trainer.common import processes\n"
        "processes.interrupt_on_signals()\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(30)\n"
        "except KeyboardInterrupt:\n"
        "    print('cleaning', flush=True)\n"
        "    time.sleep(1.5)\n"
        f"    pathlib.Path({str(done)!r}).write_text('yes')\n")
    child = subprocess.Popen([sys.executable, "-c", code],
                             stdout=subprocess.PIPE, text=True,
                             env=processes.child_env())
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline().strip() == "cleaning"
        child.send_signal(signal.SIGTERM)
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=20) == 0
    finally:
        child.kill()
        child.wait()
    assert done.read_text() == "yes"
