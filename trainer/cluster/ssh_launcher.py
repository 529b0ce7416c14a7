"""Runs a cluster over ssh: place, check every host, start, supervise.

The pieces are in ssh.py (hosts, placement, the ssh command, a task over
ssh) and preflight.py (the checks); what happens once the tasks run is
tasks.run's, as for the local launcher.
"""

import dataclasses

from absl import logging

from trainer.cluster import preflight
from trainer.cluster import ssh
from trainer.cluster import tasks

INPUT_ERROR_STATUS = 2


@dataclasses.dataclass(frozen=True)
class Remote:
    """How the hosts are reached and what runs there."""

    python: str          # the Python on every host
    remote_dir: str      # the checkout on every host
    ssh_port: int | None
    ssh_options: str     # more ssh arguments, as one string

    def argv(self, host: ssh.Host, module_args: list[str]) -> list[str]:
        """ssh running `python -m trainer.remote module_args...`."""
        return ssh.ssh_argv(host, [self.python, "-m", "trainer.remote",
                                   *module_args], self.ssh_port,
                            self.ssh_options, self.remote_dir)


def _all_hosts_pass(placements: list[ssh.Placement], remote: Remote,
                    ours: dict, check_flags: list[str]) -> bool:
    """preflight.check_hosts over ssh; logs each host's problems."""
    found = preflight.check_hosts(
        placements, ours, lambda host, ports: remote.argv(
            host, ["check", "--ports=" + ",".join(map(str, ports)),
                   *check_flags]))
    for line in found:
        logging.error("%s", line)
    if found:
        logging.error("nothing was started: %d of %d hosts failed the "
                      "check", len(found), len({p.host for p in placements}))
    return not found


def launch(hosts: list[ssh.Host], num_ps: int, num_workers: int,
           base_port: int, remote: Remote, ours: dict,
           training: list[str], check_flags: list[str],
           exit_grace_secs: float, report: str | None = None,
           worker_restarts: int = 0, console=None, on_chief_line=None,
           ps_restarts: int = 0, ps_mirrors: bool = False) -> int:
    """Runs the cluster on the hosts to the end; returns the run's exit
    status, or INPUT_ERROR_STATUS with nothing started if a host fails
    its check.

    Args:
      ours: this machine's facts (trainer.remote.facts), which every host
        must match.
      training: trainer flags for every task.
      check_flags: flags of `trainer.remote check` (--data_dir,
        --nodownload) besides the ports.
    """
    placements = ssh.place(hosts, num_ps, num_workers, base_port)
    for p in placements:
        logging.info("%s on %s at %s", p.name, p.host.destination, p.address)
    if not _all_hosts_pass(placements, remote, ours, check_flags):
        return INPUT_ERROR_STATUS
    cluster = [
        "--ps_hosts=" + ",".join(p.address for p in placements
                                 if p.job == "ps"),
        "--worker_hosts=" + ",".join(p.address for p in placements
                                     if p.job == "worker")]
    by_name = {p.name: p for p in placements}
    beats = ssh.Heartbeats()
    last: dict[str, ssh.SshTask] = {}

    def start(job: str, index: int) -> ssh.SshTask:
        p = by_name[f"{job}{index}"]
        argv = remote.argv(p.host, ["run", f"--port={p.port}", "--",
                                    f"--job_name={job}",
                                    f"--task_index={index}", *cluster,
                                    *training])
        # A worker whose host could not be reached is tried again a
        # little later, not in a tight loop of failing ssh connections.
        before = last.get(p.name)
        delay = ssh.RETRY_SECS if before and before.unreachable else 0.0
        task = ssh.start(p, argv, delay, console,
                         chief.watch(on_chief_line) if job == "worker"
                         else None)
        last[p.name] = task
        beats.tasks.append(task)
        return task

    chief = tasks.ChiefName()
    try:
        return tasks.run(start, num_ps, num_workers, exit_grace_secs,
                         report, worker_restarts, chief, ps_restarts,
                         ps_mirrors)
    finally:
        beats.stop()
