"""Simulated hosts that each run a real sshd, for the ssh launcher's tests.

`SshHosts(tmp, names)` makes a host `here` (where the launcher runs) and
one host per name, each with Debian's sshd on port 22 of its address,
logging in root with a throwaway key made for the test (no password, no
other key). A host may get its own sshd `SetEnv` lines (to give it, say,
another PYTHONPATH) or no sshd at all. Everything, sshd included, runs in
the hosts' cgroups and namespaces, and `close()` (a context manager's
exit) stops it and removes them.

Needs root, simulated hosts, `sshd` and `ssh` (apt: openssh-server);
`skip_unless_available()` says what is missing.
"""

import os
import pathlib
import shutil
import subprocess
import time

import pytest

from trainer.bench.simhosts import hosts as simhosts
from trainer.common.errors import UserError

SSHD = "/usr/sbin/sshd"


def skip_unless_available() -> None:
    for tool in (SSHD, "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not found (apt: openssh-server)")
    if os.geteuid() != 0:
        pytest.skip("needs root (simulated hosts)")


class SshHosts:

    def __init__(self, tmp: pathlib.Path, names: list[str],
                 set_env: dict[str, dict[str, str]] | None = None,
                 without_sshd: tuple[str, ...] = ()):
        """names: the hosts with sshd (or listed in without_sshd: none);
        set_env: per host, variables sshd sets for its sessions."""
        self.tmp = tmp
        try:
            self.sim = simhosts.SimulatedHosts()
        except UserError as e:
            pytest.skip(str(e))
        try:
            self.here = self.sim.add_host("here")
            self.key = self._keys()
            for name in names:
                host = self.sim.add_host(name)
                if name not in without_sshd:
                    self._sshd(host, (set_env or {}).get(name, {}))
            for name in names:
                if name not in without_sshd:
                    self._wait_for_port(self.sim.hosts[name].address, 22)
        except BaseException:
            self.sim.close()
            raise

    def _keys(self) -> pathlib.Path:
        key = self.tmp / "id_ed25519"
        for path in (key, self.tmp / "host_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "",
                            "-f", str(path)], check=True, timeout=30)
        shutil.copy(f"{key}.pub", self.tmp / "authorized_keys")
        return key

    def _sshd(self, host, set_env: dict[str, str]) -> None:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privsep folder
        config = self.tmp / f"sshd_{host.name}.conf"
        lines = [f"ListenAddress {host.address}:22",
                 f"HostKey {self.tmp / 'host_key'}",
                 f"AuthorizedKeysFile {self.tmp / 'authorized_keys'}",
                 "PermitRootLogin prohibit-password",
                 "PasswordAuthentication no", "KbdInteractiveAuthentication no",
                 "UsePAM no", "StrictModes no", "PidFile none",
                 "PrintMotd no"]
        lines += [f"SetEnv {k}={v}" for k, v in set_env.items()]
        config.write_text("\n".join(lines) + "\n")
        host.popen([SSHD, "-D", "-e", "-f", str(config)],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _wait_for_port(self, address: str, port: int,
                       timeout: float = 20.0) -> None:
        """Waits until sshd answers, asking from inside `here`."""
        deadline = time.monotonic() + timeout
        probe = ["python3", "-c", "import socket,sys; socket.create_connection"
                 f"(('{address}', {port}), timeout=1)"]
        while True:
            done = self.here.popen(probe, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
            if done.wait(timeout=10) == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"sshd on {address} did not answer")
            time.sleep(0.2)

    def ssh_options(self) -> str:
        """--ssh_options for the launcher: the throwaway key, no
        known_hosts file and no user config."""
        return (f"-F /dev/null -i {self.key} -o IdentitiesOnly=yes "
                "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                "-o LogLevel=ERROR")

    def address(self, name: str) -> str:
        return self.sim.hosts[name].address

    def close(self) -> None:
        self.sim.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

