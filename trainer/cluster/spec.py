"""Who is in the cluster and which task this process is. Pure Python.

A cluster has two jobs: `ps` tasks hold the variables, `worker` tasks compute
gradients. Worker 0 is the chief. The description comes either from flags
(`--job_name`, `--task_index`, `--ps_hosts`, `--worker_hosts`) or from the
`TF_CONFIG` environment variable in the form Kubeflow's TFJob and Vertex AI
set; flags win. Everything here is validated before any server starts.

`TF_CONFIG` may name a separate `chief` (or `master`) task. This trainer runs
it as worker 0 and shifts the `worker` entries up by one, so every process
derives the same numbering from the same `TF_CONFIG`.
"""

import dataclasses
import json
import re

from trainer.common.errors import UserError

PS = "ps"
WORKER = "worker"
JOBS = (PS, WORKER)

_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-_]*[A-Za-z0-9])?$")
_IPV6 = re.compile(r"^\[[0-9A-Fa-f:.]+\]$")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The addresses of every task; worker 0 is the chief."""

    ps: tuple[str, ...]
    workers: tuple[str, ...]

    @property
    def num_ps(self) -> int:
        return len(self.ps)

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def as_dict(self) -> dict[str, list[str]]:
        """The job -> addresses mapping `tf.train.ClusterSpec` takes."""
        return {PS: list(self.ps), WORKER: list(self.workers)}

    def address(self, job: str, index: int) -> str:
        return (self.ps if job == PS else self.workers)[index]

    def describe(self, job: str, index: int) -> str:
        """A task as users see it in messages, e.g. 'worker 1 (host:2223)'."""
        return f"{job} {index} ({self.address(job, index)})"


CHIEF_UNLESS = ", the chief unless another worker does its work"


@dataclasses.dataclass(frozen=True)
class Task:
    """The cluster plus the role of this process in it."""

    cluster: Cluster
    job_name: str
    task_index: int
    source: str  # "flags" or "TF_CONFIG"; said in the first log line.

    @property
    def is_chief(self) -> bool:
        return self.job_name == WORKER and self.task_index == 0

    @property
    def address(self) -> str:
        return self.cluster.address(self.job_name, self.task_index)

    def describe(self) -> str:
        """'worker 0 (host:2223), the chief unless ...': worker 0 does the
        chief's work unless another worker took it over."""
        text = self.cluster.describe(self.job_name, self.task_index)
        return text + (CHIEF_UNLESS if self.is_chief else "")


def split_address(address: str, where: str) -> tuple[str, int]:
    """Splits 'host:port' and checks both parts; `where` names the source."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise UserError(
            f"{where}: '{address}' is not host:port; write it like "
            "'localhost:2222' or '10.0.0.5:2222'")
    if not (_HOSTNAME.match(host) or _IPV6.match(host)):
        raise UserError(
            f"{where}: '{host}' in '{address}' is not a valid host name; "
            "use a name, an IPv4 address or a bracketed IPv6 address")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise UserError(
            f"{where}: port '{port_text}' in '{address}' is not a number "
            "from 1 to 65535")
    return host, int(port_text)


def parse_host_list(text: str, where: str) -> tuple[str, ...]:
    """'h1:p1,h2:p2' -> ('h1:p1', 'h2:p2'), each address checked."""
    addresses = tuple(part.strip() for part in text.split(",") if part.strip())
    for address in addresses:
        split_address(address, where)
    return addresses


def make_cluster(ps: tuple[str, ...], workers: tuple[str, ...],
                 where: str) -> Cluster:
    """Checks that both jobs exist and that no address repeats."""
    if not ps:
        raise UserError(
            f"{where}: the cluster has no ps task; list at least one "
            "ps address (variables live on the ps tasks)")
    if not workers:
        raise UserError(
            f"{where}: the cluster has no worker task; list at least one "
            "worker address")
    seen: dict[tuple[str, int], str] = {}
    for job, addresses in ((PS, ps), (WORKER, workers)):
        for index, address in enumerate(addresses):
            host, port = split_address(address, where)
            key = (host.lower(), port)
            if key in seen:
                raise UserError(
                    f"{where}: address {address} is used by both "
                    f"{seen[key]} and {job} {index}; give every task its "
                    "own host:port")
            seen[key] = f"{job} {index}"
    return Cluster(ps=tuple(ps), workers=tuple(workers))


def make_task(cluster: Cluster, job_name: str, task_index: int,
              source: str) -> Task:
    """Checks the role against the cluster."""
    if job_name not in JOBS:
        raise UserError(
            f"{source}: unknown job '{job_name}'; use 'ps' or 'worker'")
    size = cluster.num_ps if job_name == PS else cluster.num_workers
    if not 0 <= task_index < size:
        raise UserError(
            f"{source}: task index {task_index} is out of range for job "
            f"'{job_name}', which has {size} task(s) (indices 0 to "
            f"{size - 1})")
    return Task(cluster=cluster, job_name=job_name, task_index=task_index,
                source=source)


def from_flags(job_name: str, task_index: int, ps_hosts: str,
               worker_hosts: str) -> Task:
    """Builds the task from the four cluster flags."""
    cluster = make_cluster(parse_host_list(ps_hosts, "--ps_hosts"),
                           parse_host_list(worker_hosts, "--worker_hosts"),
                           "flags")
    return make_task(cluster, job_name, task_index, "flags")


def from_tf_config(text: str) -> Task:
    """Builds the task from a TF_CONFIG JSON string.

    Accepts {"cluster": {"ps": [...], "worker": [...], "chief": [one]},
    "task": {"type": "worker", "index": 0}}; "master" is taken as "chief".
    """
    where = "TF_CONFIG"
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{where} is not valid JSON ({e.msg} at character {e.pos}); "
            "fix the environment variable or unset it") from None
    if not isinstance(config, dict):
        raise UserError(f"{where} must be a JSON object with 'cluster' and "
                        "'task'")
    for key in ("cluster", "task"):
        if not isinstance(config.get(key), dict):
            raise UserError(
                f"{where} has no '{key}' object; it needs both 'cluster' "
                "and 'task' (see "
                "docs/deploying.md#tf_config-kubeflow-tfjob-vertex-ai)")
    cluster, chief_job = _tf_config_cluster(config["cluster"])
    return _tf_config_task(config["task"], config["cluster"], cluster,
                           chief_job)


def _tf_config_cluster(jobs: dict) -> tuple[Cluster, str]:
    """TF_CONFIG's 'cluster' -> the cluster (chief first among the
    workers) and the name its chief job has ("chief" or "master")."""
    where = "TF_CONFIG"

    def addresses(job: str) -> tuple[str, ...]:
        value = jobs.get(job, [])
        if not isinstance(value, list) or not all(
                isinstance(a, str) for a in value):
            raise UserError(f"{where}: cluster.{job} must be a list of "
                            "'host:port' strings")
        for address in value:
            split_address(address, f"{where} cluster.{job}")
        return tuple(value)

    unknown_jobs = sorted(set(jobs) - {"ps", "worker", "chief", "master"})
    if unknown_jobs:
        raise UserError(
            f"{where}: job(s) {', '.join(unknown_jobs)} in 'cluster' are "
            "not supported by this trainer (supported: chief or master, "
            "worker, ps)")
    if "chief" in jobs and "master" in jobs:
        raise UserError(f"{where}: give either 'chief' or 'master' in "
                        "'cluster', not both")
    chief_job = "chief" if "chief" in jobs else "master"
    chief = addresses(chief_job)
    if len(chief) > 1:
        raise UserError(f"{where}: cluster.{chief_job} must list exactly one "
                        f"address, not {len(chief)}")
    return make_cluster(addresses("ps"), chief + addresses("worker"),
                        where), chief_job


def _tf_config_task(task: dict, jobs: dict, cluster: Cluster,
                    chief_job: str) -> Task:
    """TF_CONFIG's 'task' -> this task; a chief or master is worker 0."""
    where = "TF_CONFIG"
    task_type = task.get("type")
    task_index = task.get("index", 0)
    if not isinstance(task_index, int) or isinstance(task_index, bool):
        raise UserError(f"{where}: task.index must be an integer, not "
                        f"{task_index!r}")
    if task_type not in jobs or task_type not in ("ps", "worker", "chief",
                                                  "master"):
        listed = ", ".join(sorted(jobs)) or "none"
        raise UserError(
            f"{where}: task type {task_type!r} is not a job in 'cluster' "
            f"(jobs listed: {listed})")
    if task_type in ("chief", "master"):
        if task_index != 0:
            raise UserError(f"{where}: the {task_type} task has index 0, "
                            f"not {task_index}")
        return make_task(cluster, WORKER, 0, where)
    if task_type == WORKER and jobs.get(chief_job):
        worker_count = len(cluster.workers) - 1
        if not 0 <= task_index < worker_count:
            raise UserError(
                f"{where}: task index {task_index} is out of range for job "
                f"'worker', which has {worker_count} task(s) besides the "
                f"{chief_job}")
        return make_task(cluster, WORKER, task_index + 1, where)
    return make_task(cluster, task_type, task_index, where)


def resolve(job_name: str | None, task_index: int | None,
            ps_hosts: str | None, worker_hosts: str | None,
            tf_config: str | None) -> Task:
    """Picks the cluster description: flags if any is given, else TF_CONFIG.

    Args:
      job_name, task_index, ps_hosts, worker_hosts: flag values, or None
        when the flag was not given on the command line.
      tf_config: the TF_CONFIG environment variable, or None if unset.
    """
    flags_given = [name for name, value in (
        ("--job_name", job_name), ("--ps_hosts", ps_hosts),
        ("--worker_hosts", worker_hosts), ("--task_index", task_index))
        if value is not None]
    if flags_given:
        missing = [name for name, value in (
            ("--job_name", job_name), ("--ps_hosts", ps_hosts),
            ("--worker_hosts", worker_hosts)) if not value]
        if missing:
            raise UserError(
                f"{', '.join(flags_given)} given but {', '.join(missing)} "
                "missing; pass all of --job_name, --ps_hosts and "
                "--worker_hosts (flags override TF_CONFIG)")
        return from_flags(job_name, task_index or 0, ps_hosts, worker_hosts)
    if tf_config:
        return from_tf_config(tf_config)
    raise UserError(
        "no cluster given; pass --job_name, --task_index, --ps_hosts and "
        "--worker_hosts, set TF_CONFIG, or run a whole local cluster with "
        "python -m trainer.launch")
