"""The cluster of a Slurm job step (`srun ... python -m trainer.main
--cluster=slurm`). Pure Python: no TensorFlow, so flag errors stay fast.

Every task of the step computes the same cluster from the same step
environment, so nothing needs to be exchanged:

* Tasks are numbered by SLURM_PROCID (0 .. SLURM_STEP_NUM_TASKS - 1). The
  first `num_ps` are the ps tasks, the rest the workers in order; the first
  worker is the chief.
* Slurm's default distribution is block: node 0 of SLURM_STEP_NODELIST gets
  tasks 0 .. k0 - 1, node 1 the next k1, ..., with k0, k1, ... from
  SLURM_STEP_TASKS_PER_NODE. A task's port is `base_port` plus its index on
  its node, so several tasks share a node without clashing, and the same
  ports are used on every node.
* Each task checks that its own SLURM_NODEID and SLURM_LOCALID agree with
  that layout; they do not under `--distribution=cyclic` or an arbitrary
  one, which would give wrong addresses, so those are refused.

TensorFlow's `SlurmClusterResolver` does much the same (its port base is
8888 too) but imports TensorFlow and names jobs differently; this module is
the few lines this trainer needs.
"""

from collections.abc import Callable, Mapping
import re
import subprocess

from trainer.cluster import spec as cluster_lib
from trainer.common.errors import UserError

SOURCE = "Slurm"  # Task.source: the first log line says "cluster from Slurm".
DEFAULT_BASE_PORT = 8888  # SlurmClusterResolver's port_base; see README.
SCONTROL_TIMEOUT_SECS = 30

# "2(x3),1" -> 2, 2, 2, 1: a count, optionally repeated "(xN)" times.
_TASKS_PER_NODE_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def in_slurm(environ: Mapping[str, str]) -> bool:
    """True when this process is a task of a Slurm job (srun or sbatch)."""
    return "SLURM_PROCID" in environ or "SLURM_JOB_ID" in environ


def expand_hostlist(nodelist: str) -> list[str]:
    """'node[1-3],gpu7' -> ['node1', 'node2', 'node3', 'gpu7'], in order.

    Uses `scontrol show hostnames`, which parses Slurm's compressed host
    list locally (it does not contact the controller).
    """
    command = ["scontrol", "show", "hostnames", nodelist]
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_SECS, check=False,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise UserError(
            "--cluster=slurm: 'scontrol' is not on PATH; run on a node with "
            "the Slurm client commands installed, or give the cluster with "
            "--ps_hosts/--worker_hosts") from None
    except subprocess.TimeoutExpired:
        raise UserError(
            f"--cluster=slurm: 'scontrol show hostnames {nodelist}' did not "
            f"answer within {SCONTROL_TIMEOUT_SECS} s; check the Slurm "
            "installation on this node") from None
    if done.returncode != 0:
        # scontrol logs lookups it tried first; its last line is the cause.
        why = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(
            f"--cluster=slurm: 'scontrol show hostnames {nodelist}' failed "
            f"(status {done.returncode}: {why}); check the node list and "
            "that this node's Slurm configuration is readable")
    return done.stdout.split()


def _variable(environ: Mapping[str, str], *names: str) -> tuple[str, str]:
    """The first of `names` that is set: (name, value); else a UserError."""
    for name in names:
        if environ.get(name, "").strip():
            return name, environ[name].strip()
    raise UserError(
        f"--cluster=slurm: {' or '.join(names)} is not set; start every "
        "task with srun inside a Slurm job (e.g. srun --ntasks=3 python -m "
        "trainer.main --cluster=slurm ...)")


def _integer(environ: Mapping[str, str], *names: str) -> int:
    name, value = _variable(environ, *names)
    if not value.isdigit():
        raise UserError(
            f"--cluster=slurm: {name}='{value}' is not a non-negative "
            "integer; run under srun, which sets it")
    return int(value)


def parse_tasks_per_node(text: str, name: str) -> list[int]:
    """Slurm's '2(x3),1' -> [2, 2, 2, 1]; `name` is the variable's name."""
    counts = []
    for item in text.split(","):
        match = _TASKS_PER_NODE_ITEM.match(item.strip())
        if not match:
            raise UserError(
                f"--cluster=slurm: {name}='{text}' is not a list like "
                "'2(x3),1'; run under srun, which sets it")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def layout(hosts: list[str], tasks_per_node: list[int],
           base_port: int) -> list[str]:
    """Every task's 'host:port' by SLURM_PROCID (block distribution)."""
    return [f"{host}:{base_port + local}"
            for host, count in zip(hosts, tasks_per_node)
            for local in range(count)]


def task_from_slurm(
        environ: Mapping[str, str], num_ps: int,
        base_port: int = DEFAULT_BASE_PORT,
        hostnames: Callable[[str], list[str]] = expand_hostlist,
) -> cluster_lib.Task:
    """This process's role in the cluster made of its Slurm job step.

    Args:
      environ: the environment (os.environ) of one task started by srun.
      num_ps: how many of the step's tasks are ps tasks (the first ones).
      base_port: the port of the first task on each node; the task with
        index L on its node listens on base_port + L.
      hostnames: expands a Slurm node list to host names (tests fake it).

    Raises:
      UserError: outside a job step, on unreadable Slurm variables, on a
        non-block distribution, or when the counts or ports do not fit.
    """
    if not in_slurm(environ):
        raise UserError(
            "--cluster=slurm but this process is not in a Slurm job (no "
            "SLURM_PROCID); start it with srun, or give the cluster with "
            "--ps_hosts/--worker_hosts or TF_CONFIG")
    procid = _integer(environ, "SLURM_PROCID")
    ntasks = _integer(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    _check_counts(num_ps, ntasks)
    nodes_name, nodelist = _variable(environ, "SLURM_STEP_NODELIST",
                                     "SLURM_JOB_NODELIST")
    per_node_name, per_node_text = _variable(environ,
                                             "SLURM_STEP_TASKS_PER_NODE")
    tasks_per_node = parse_tasks_per_node(per_node_text, per_node_name)
    hosts = hostnames(nodelist)
    if len(hosts) != len(tasks_per_node):
        raise UserError(
            f"--cluster=slurm: {nodes_name}='{nodelist}' names "
            f"{len(hosts)} node(s) but {per_node_name}='{per_node_text}' "
            f"gives task counts for {len(tasks_per_node)}; run under srun")
    if sum(tasks_per_node) != ntasks or not 0 <= procid < ntasks:
        raise UserError(
            f"--cluster=slurm: SLURM_PROCID={procid} and {ntasks} task(s) "
            f"do not match {per_node_name}='{per_node_text}'; run under "
            "srun, which sets them consistently")
    _check_ports(base_port, max(tasks_per_node))
    _check_block_layout(environ, tasks_per_node, procid)
    addresses = layout(hosts, tasks_per_node, base_port)
    cluster = cluster_lib.make_cluster(tuple(addresses[:num_ps]),
                                       tuple(addresses[num_ps:]), SOURCE)
    if procid < num_ps:
        return cluster_lib.make_task(cluster, cluster_lib.PS, procid, SOURCE)
    return cluster_lib.make_task(cluster, cluster_lib.WORKER,
                                 procid - num_ps, SOURCE)


def _check_counts(num_ps: int, ntasks: int) -> None:
    if num_ps < 1:
        raise UserError(
            f"--num_ps={num_ps}: the cluster needs at least one ps task; "
            "use --num_ps=1 or more")
    if ntasks - num_ps < 1:
        raise UserError(
            f"--num_ps={num_ps} leaves no worker among the step's {ntasks} "
            f"task(s); start at least {num_ps + 1} tasks (srun --ntasks) or "
            "lower --num_ps")


def _check_ports(base_port: int, most_per_node: int) -> None:
    last = base_port + most_per_node - 1
    if base_port < 1 or last > 65535:
        raise UserError(
            f"--slurm_base_port={base_port}: with {most_per_node} task(s) "
            f"on a node the ports run to {last}, outside 1 to 65535; pick a "
            "base port such as 8888")


def _check_block_layout(environ: Mapping[str, str],
                        tasks_per_node: list[int], procid: int) -> None:
    """Refuses a distribution other than block, where our addresses would
    be wrong, using the node and local index Slurm gave this task."""
    node, first = 0, 0
    while procid >= first + tasks_per_node[node]:
        first += tasks_per_node[node]
        node += 1
    expected = {"SLURM_NODEID": node, "SLURM_LOCALID": procid - first}
    for name, value in expected.items():
        if name in environ and environ[name].strip() != str(value):
            raise UserError(
                f"--cluster=slurm: task {procid} runs with {name}="
                f"{environ[name].strip()}, not {value} as block distribution "
                "puts it; run srun with --distribution=block (the default)")
