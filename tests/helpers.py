"""Shared test helpers: tiny IDX files and bounded runs of real processes."""

import gzip
import os
import pathlib
import signal
import struct
import subprocess
import sys

import numpy as np

from trainer.common import processes

REPO = pathlib.Path(__file__).resolve().parent.parent
SHARED_MNIST = REPO.parent / "shared" / "mnist"


def free_ports(count: int) -> list[int]:
    """Loopback ports that are free now (the launcher's choice of them)."""
    from trainer.cluster import local as launcher
    return launcher.free_ports("localhost", count)


def wait_until_listening(address: str, timeout: float) -> None:
    """Waits (at most `timeout` s) until host:port accepts connections."""
    import time
    from trainer.cluster import ports
    deadline = time.monotonic() + timeout
    while ports.answer(address, 1.0) != ports.OPEN:
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on {address} after "
                                 f"{timeout:.0f} s")
        time.sleep(0.1)


def real_mnist_dir() -> pathlib.Path | None:
    """The full MNIST copy, from $MNIST_DATA_DIR or ../shared/mnist."""
    for candidate in (os.environ.get("MNIST_DATA_DIR"), SHARED_MNIST):
        if candidate and (pathlib.Path(candidate) /
                          "train-images-idx3-ubyte.gz").exists():
            # Absolute, because tests run commands from other directories.
            return pathlib.Path(candidate).resolve()
    return None


def idx_bytes(array: np.ndarray, magic: int) -> bytes:
    """An IDX file's bytes: magic, big-endian dimensions, uint8 data."""
    header = struct.pack(">I", magic) + b"".join(
        struct.pack(">I", d) for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_gz(path: pathlib.Path, payload: bytes) -> pathlib.Path:
    with gzip.open(path, "wb") as f:
        f.write(payload)
    return path


def write_images(path, images: np.ndarray) -> pathlib.Path:
    return write_gz(path, idx_bytes(images, 0x803))


def write_labels(path, labels: np.ndarray) -> pathlib.Path:
    return write_gz(path, idx_bytes(labels, 0x801))


def fake_mnist(folder: pathlib.Path, train: int = 640, test: int = 100,
               seed: int = 0) -> pathlib.Path:
    """Writes a small learnable MNIST look-alike: class k lights row band k."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def make(n):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 30, (n, 28, 28)).astype(np.uint8)
        for i, label in enumerate(labels):
            images[i, 2 + 2 * label:4 + 2 * label, 4:24] = 160
        return images, labels

    images, labels = make(train)
    write_images(folder / "train-images-idx3-ubyte.gz", images)
    write_labels(folder / "train-labels-idx1-ubyte.gz", labels)
    images, labels = make(test)
    write_images(folder / "t10k-images-idx3-ubyte.gz", images)
    write_labels(folder / "t10k-labels-idx1-ubyte.gz", labels)
    return folder


def python_env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run(args: list[str], timeout: float, env: dict | None = None
        ) -> subprocess.CompletedProcess:
    """Runs `python args...` with a bound; kills its whole group on timeout.

    Processes the command starts in sessions of their own (the launcher's
    tasks) die with it: the launcher asks the kernel for that.
    """
    process = subprocess.Popen(
        [sys.executable] + args, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env or python_env(),
        cwd=REPO, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(
            f"timed out after {timeout} s: {' '.join(args)}\n{output[-4000:]}")
    return subprocess.CompletedProcess(args, process.returncode, output, "")


def interrupt_launch(args: list[str], when: str, timeout: float = 120
                     ) -> tuple[int, str]:
    """Runs `python -m trainer.launch args...`, sends it SIGINT (Ctrl-C)
    once a line of its output contains `when`, and returns its exit status
    and output. Every wait is bounded; the launcher's group is killed if it
    outlives the test.

    The launcher starts with SIGINT ignored, as a command started from a
    script's background job (`cmd &`) or under nohup inherits it: Ctrl-C
    must work however the launcher (or this test run) was started.
    """
    import threading
    import time
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer.launch", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=python_env(), cwd=REPO, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout
        while not any(when in line for line in lines):
            assert time.monotonic() < deadline, "".join(lines)[-3000:]
            assert process.poll() is None, "".join(lines)[-3000:]
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        # The launcher waits for the chief's stop (CHIEF_STOP_SECS at most).
        try:
            status = process.wait(timeout=processes.CHIEF_STOP_SECS + 15)
        except subprocess.TimeoutExpired:
            raise AssertionError("still running after Ctrl-C:\n"
                                 + "".join(lines)[-4000:]) from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    reader.join(timeout=10)
    return status, "".join(lines)


def launch(logdir: pathlib.Path, data_dir: pathlib.Path, num_workers: int,
           *flags: str, num_ps: int = 1, timeout: float = 180
           ) -> subprocess.CompletedProcess:
    """Runs `python -m trainer.launch` on a local cluster to the end."""
    return run(["-m", "trainer.launch", f"--num_ps={num_ps}",
                f"--num_workers={num_workers}", f"--logdir={logdir}",
                f"--data_dir={data_dir}", "--nodownload", *flags],
               timeout=timeout)


class ManualCluster:
    """Tasks started one by one with `python -m trainer.main`, for tests
    that kill and restart them. Every wait is bounded; `close()` kills
    whatever is still running."""

    def __init__(self, tmp_path: pathlib.Path, num_ps: int, num_workers: int,
                 *flags: str):
        ports = free_ports(num_ps + num_workers)
        self.ps_hosts = ",".join(f"localhost:{p}" for p in ports[:num_ps])
        self.worker_hosts = ",".join(f"localhost:{p}"
                                     for p in ports[num_ps:])
        self.flags = list(flags)
        self.dir = tmp_path
        self.processes: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}

    def log_path(self, name: str, start: int | None = None) -> pathlib.Path:
        start = self.starts[name] if start is None else start
        return self.dir / f"{name}.{start}.log"

    def start(self, job: str, index: int, *extra: str) -> str:
        """Starts a task; workers get the launcher's thread counts, so
        their arithmetic (and so their parameters) matches a launched run
        bit for bit."""
        from trainer.cluster import local as launcher
        name = f"{job}{index}"
        if job == "worker":
            extra = tuple(f"--{flag}={value}" for flag, value in
                          launcher.default_worker_threads(
                              len(self.worker_hosts.split(","))).items()
                          ) + extra
        self.starts[name] = self.starts.get(name, -1) + 1
        log = open(self.log_path(name), "w")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "trainer.main", f"--job_name={job}",
             f"--task_index={index}", f"--ps_hosts={self.ps_hosts}",
             f"--worker_hosts={self.worker_hosts}", *self.flags, *extra],
            stdout=log, stderr=subprocess.STDOUT, env=python_env(), cwd=REPO,
            start_new_session=True)
        return name

    def log(self, name: str, start: int | None = None) -> str:
        path = self.log_path(name, start)
        return path.read_text() if path.exists() else ""

    def wait_for(self, name: str, pattern: str, timeout: float = 120.0):
        """Waits until the task's current log matches `pattern` (a regex)."""
        import re
        import time
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log(name))
            if match:
                return match
            if self.processes[name].poll() is not None:
                raise AssertionError(
                    f"{name} exited with {self.processes[name].returncode} "
                    f"before /{pattern}/:\n{self.log(name)[-3000:]}"
                    f"{self.story()}")
            time.sleep(0.1)
        raise AssertionError(f"{name}: no /{pattern}/ in {timeout} s:\n"
                             f"{self.log(name)[-3000:]}{self.story()}")

    def story(self, lines: int = 30) -> str:
        """Each task's warnings and errors, and the chief's decisions
        (the last `lines` of each): what a failed wait shows beside the
        tail of one log, as CI keeps nothing else."""
        import re
        told = re.compile(r"^[WE]\d{4} |(chief|mirrors|serving|takeover)"
                          r"\.py:\d+\]")
        out = []
        for name in sorted(self.processes):
            kept = [line[:240] for line in self.log(name).splitlines()
                    if told.search(line)]
            out.append(f"\n--- {name}:\n" + "\n".join(kept[-lines:]))
        return "".join(out)

    def kill(self, name: str) -> None:
        """SIGKILL, as a machine that loses power."""
        process = self.processes[name]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def wait(self, name: str, timeout: float = 180.0) -> int:
        try:
            return self.processes[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout} s:\n"
                                 f"{self.log(name)[-3000:]}") from None

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
