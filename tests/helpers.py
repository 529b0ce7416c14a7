"""Shared test helpers: tiny IDX files and bounded runs of real processes."""

import gzip
import os
import pathlib
import signal
import socket
import struct
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
SHARED_MNIST = REPO.parent / "shared" / "mnist"


def free_ports(count: int) -> list[int]:
    """Loopback ports that are free now, distinct from one another."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def real_mnist_dir() -> pathlib.Path | None:
    """The full MNIST copy, from $MNIST_DATA_DIR or ../shared/mnist."""
    for candidate in (os.environ.get("MNIST_DATA_DIR"), SHARED_MNIST):
        if candidate and (pathlib.Path(candidate) /
                          "train-images-idx3-ubyte.gz").exists():
            return pathlib.Path(candidate)
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


def launch(logdir: pathlib.Path, data_dir: pathlib.Path, num_workers: int,
           *flags: str, num_ps: int = 1, timeout: float = 180
           ) -> subprocess.CompletedProcess:
    """Runs `python -m trainer.launch` on a local cluster to the end."""
    return run(["-m", "trainer.launch", f"--num_ps={num_ps}",
                f"--num_workers={num_workers}", f"--logdir={logdir}",
                f"--data_dir={data_dir}", "--nodownload", *flags],
               timeout=timeout)
