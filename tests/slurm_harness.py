"""A throwaway single-node Slurm for tests: munged, slurmctld and slurmd.

    with SlurmCluster() as slurm:
        done = slurm.srun(["--ntasks=3", "--overcommit", "hostname"], 60)

Everything lives in one temporary folder that the harness makes and
removes (config, MUNGE key and socket, state, spool, logs); every daemon is
a child process started in the foreground, so its pid is the daemon's, and
`stop()` ends it by that pid.

What it took on the 2-core Debian 12 development machine (Slurm 22.05,
MUNGE 0.5.15, running as root, no systemd, /sys/fs/cgroup not a cgroup fs):

* munged refuses a socket in a folder that is not executable by all
  ("Socket is inaccessible"), and that goes for every folder above it, so
  the harness makes its own 0755 folder in the system temporary folder
  (pytest's tmp_path sits under a 0700 folder) and keeps the key in a 0700
  folder below it, mode 0400.
  `--foreground` keeps it our child; running as root is accepted.
* Slurm finds that socket through `AuthInfo=socket=...`, which serves both
  auth/munge and cred/munge.
* No cgroup anything: ProctrackType=proctrack/pgid, TaskPlugin=task/none,
  JobAcctGatherType=jobacct_gather/none, and no cgroup.conf.
* The node is called `localhost` (`slurmd -N localhost`, NodeAddr and
  NodeHostname 127.0.0.1/localhost) and so is the controller: slurmctld
  accepts SlurmctldHost=localhost on any machine, and the node list the
  tasks see (SLURM_STEP_NODELIST=localhost) resolves everywhere, whatever
  the machine's own host name.
* The node's CPUs/Boards/Sockets/Cores/Threads are copied from `slurmd -C`;
  slurmd logs an error when the configured layout differs from the hardware.
* Three tasks on two CPUs: OverSubscribe=FORCE on the partition is not
  enough; without `srun --overcommit` the job waits forever ("Requested
  partition configuration not available now"). With it, select/linear
  starts all three at once.
* slurmd logs errors about mpi/pmix it cannot load; MpiDefault=none makes
  them harmless.
* A batch step (sbatch without srun) has SLURM_PROCID=0 but no
  SLURM_STEP_* variables.
* slurmd does not end running steps when it stops, so `stop()` first
  cancels every job and waits for each slurmstepd (found through the unix
  sockets it holds in our spool folder) to go.
"""

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sinfo", "scontrol", "squeue", "scancel")
NODE = "localhost"
STOP_GRACE_SECS = 10


def missing_requirement() -> str | None:
    """Why a real Slurm cannot be started here, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs job steps as their user)"
    missing = [p for p in DAEMONS + CLIENTS if shutil.which(p) is None]
    if missing:
        return (f"{', '.join(missing)} not installed; run "
                ".ci/install_slurm.sh (Debian packages slurm-wlm munge)")
    return None


def _free_ports(count: int) -> list[int]:
    """Loopback ports free right now (kept bound until all are chosen)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _hardware_line() -> str:
    """The node's CPU layout from `slurmd -C` (avoids a mismatch error)."""
    done = subprocess.run(["slurmd", "-C"], capture_output=True, text=True,
                          timeout=30, check=True, stdin=subprocess.DEVNULL)
    first = done.stdout.splitlines()[0].split()
    keep = ("CPUs=", "Boards=", "SocketsPerBoard=", "CoresPerSocket=",
            "ThreadsPerCore=")
    return " ".join(word for word in first if word.startswith(keep))


def make_root(root: pathlib.Path) -> None:
    """Makes a harness's folder: MUNGE key and socket folders, state,
    spool, logs and an empty plugstack.conf (see the module docstring)."""
    # munged checks every folder above its socket; mkdir obeys umask.
    closed = [str(p) for p in root.parents if not p.stat().st_mode & 0o001]
    if closed:
        raise RuntimeError(
            f"munged needs every folder above its socket open to all "
            f"(o+x), and {closed[0]} is not; set TMPDIR to one that is")
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    for sub, mode in (("munge-etc", 0o700), ("munge-run", 0o755),
                      ("state", 0o755), ("spool", 0o755), ("log", 0o755)):
        (root / sub).mkdir(parents=True, exist_ok=True)
        (root / sub).chmod(mode)
    key = root / "munge-etc" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (root / "plugstack.conf").write_text("")


def munged_argv(root: pathlib.Path) -> list[str]:
    """munged in the foreground with everything in `root`."""
    return ["munged", "--foreground",
            f"--socket={root / 'munge-run' / 'munge.sock'}",
            f"--key-file={root / 'munge-etc' / 'munge.key'}",
            f"--seed-file={root / 'munge-etc' / 'munged.seed'}",
            f"--pid-file={root / 'munge-run' / 'munged.pid'}",
            f"--log-file={root / 'log' / 'munged.log'}"]


def common_config(root: pathlib.Path) -> str:
    """The slurm.conf lines every harness shares (no cgroups, no
    accounting, MUNGE through our socket, files in `root`)."""
    return f"""\
ClusterName=throwaway
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root / 'munge-run' / 'munge.sock'}
StateSaveLocation={root / 'state'}
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmctldLogFile={root / 'log' / 'slurmctld.log'}
PlugStackConfig={root / 'plugstack.conf'}
SelectType=select/linear
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2"""


class SlurmCluster:
    """munged + slurmctld + slurmd on this machine, in a folder of its own
    (`root`, made by start() and removed by stop())."""

    def __init__(self, ready_timeout_secs: float = 30):
        self.root = pathlib.Path(tempfile.gettempdir()) / (
            f"throwaway-slurm-{uuid.uuid4().hex[:8]}")
        self.ready_timeout_secs = ready_timeout_secs
        self.conf = self.root / "slurm.conf"
        self.logs = self.root / "log"
        self.spool = self.root / "spool"
        self.socket = self.root / "munge-run" / "munge.sock"
        self._procs: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict:
        """The environment for Slurm commands: ours, without any SLURM_*
        of an enclosing job, and with SLURM_CONF pointing at our config."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SLURM")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Writes the config, starts the daemons, waits for an idle node.
        Stops whatever it started if that fails."""
        try:
            self._write_files()
            self._spawn("munged", munged_argv(self.root))
            self._wait_for(self.socket.exists, "munged's socket")
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._spawn("slurmd", ["slurmd", "-D", "-N", NODE,
                                   "-f", str(self.conf)])
            self._wait_for(self._node_idle, "node 'localhost' idle in sinfo")
        except BaseException:
            self.stop()
            raise

    def _write_files(self) -> None:
        make_root(self.root)
        self.conf.write_text(self._config_text())

    def _config_text(self) -> str:
        ctld_port, slurmd_port = _free_ports(2)
        return f"""\
SlurmctldHost={NODE}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmdSpoolDir={self.spool}
SlurmdPidFile={self.root / 'slurmd.pid'}
SlurmdLogFile={self.logs / 'slurmd.log'}
{common_config(self.root)}
NodeName={NODE} NodeAddr=127.0.0.1 NodeHostname={NODE} {_hardware_line()}
PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP \
OverSubscribe=FORCE
"""

    def _spawn(self, name: str, command: list[str]) -> None:
        with open(self.logs / f"{name}.out", "wb") as out:
            self._procs[name] = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True)  # no terminal signals from pytest

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_secs
        while not ready():
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with status {proc.returncode} while "
                        f"waiting for {what}:\n{self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no {what} after {self.ready_timeout_secs} s:\n" +
                    "\n".join(self.log_tail(n) for n in self._procs))
            time.sleep(0.2)

    def _node_idle(self) -> bool:
        done = self.command(["sinfo", "--noheader", "--format=%t"], 10,
                            check=False)
        return done.returncode == 0 and done.stdout.split() == ["idle"]

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.logs / f"{name}.out"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- {name}:\n" + "\n".join(text.splitlines()[-lines:])

    def client(self, argv: list[str]) -> list[str]:
        """A Slurm client command as run against this cluster (as is here;
        the multi-node harness runs it in the controller's namespace)."""
        return argv

    def command(self, args: list[str], timeout: float,
                check: bool = True) -> subprocess.CompletedProcess:
        """Runs a Slurm client command against this cluster."""
        return subprocess.run(self.client(args), env=self.env,
                              capture_output=True,
                              text=True, timeout=timeout, check=check,
                              stdin=subprocess.DEVNULL)

    def srun(self, args: list[str], timeout: float, cwd: str | None = None,
             env: dict | None = None) -> subprocess.CompletedProcess:
        """Runs `srun ARGS` to the end (run_client)."""
        return self.run_client(["srun", *args], timeout, cwd, env)

    def run_client(self, argv: list[str], timeout: float, cwd=None,
                   env: dict | None = None) -> subprocess.CompletedProcess:
        """Runs a job-starting client (srun, salloc) to the end, with a job
        name of its own; stdout and stderr merged, no stdin.

        On timeout the job is cancelled and the client killed, then
        subprocess.TimeoutExpired is raised with the output so far.
        """
        name = f"test-{uuid.uuid4().hex[:8]}"
        command = self.client([argv[0], f"--job-name={name}",
                               *(["--input=none"] if argv[0] == "srun"
                                 else []), *argv[1:]])
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, cwd=cwd,
            env={**self.env, **(env or {})}, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.command(["scancel", f"--name={name}"], 30, check=False)
            proc.kill()
            out, _ = proc.communicate(timeout=30)
            raise subprocess.TimeoutExpired(command, timeout, output=out)
        return subprocess.CompletedProcess(command, proc.returncode, out)

    def stop(self) -> None:
        """Cancels every job, then stops slurmd, slurmctld and munged by pid
        (SIGTERM, SIGKILL after a grace). Safe to call twice."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() \
                is None:
            self.command(["scancel", "--user=root"], 30,
                         check=False)
        self._wait_stepds_gone()
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.pop(name, None)
            if proc is not None:
                _terminate(proc)
        shutil.rmtree(self.root, ignore_errors=True)

    def _wait_stepds_gone(self) -> None:
        """Waits for the slurmstepd of each step of ours to exit; kills by
        pid any still there after the grace (they hold our spool sockets)."""
        deadline = time.monotonic() + STOP_GRACE_SECS
        while self.stepd_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in self.stepd_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stepd_pids(self) -> set[int]:
        """Pids of processes holding a unix socket in our spool folder:
        the slurmstepd of every step that our slurmd started."""
        inodes = set()
        with open("/proc/net/unix") as f:
            next(f)
            for line in f:
                fields = line.split()
                if len(fields) >= 8 and fields[7].startswith(f"{self.spool}/"):
                    inodes.add(f"socket:[{fields[6]}]")
        pids = set()
        for entry in pathlib.Path("/proc").iterdir():
            if not entry.name.isdigit() or not inodes:
                continue
            try:
                links = {os.readlink(fd) for fd in (entry / "fd").iterdir()}
            except OSError:  # exited meanwhile, or not ours to read
                continue
            if links & inodes:
                pids.add(int(entry.name))
        return pids

    def pids(self) -> dict[str, int]:
        """The daemons' pids, by name."""
        return {name: proc.pid for name, proc in self._procs.items()}


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_SECS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_GRACE_SECS)
