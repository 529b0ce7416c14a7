"""The cluster of pods of two StatefulSets (`python -m trainer.main
--cluster=kubernetes`), for Kubernetes without the TFJob operator. Pure
Python: no TensorFlow, no Kubernetes API.

deploy/kubernetes.yaml makes, for a run named NAME, a headless Service and
a StatefulSet per job, each Service named as its StatefulSet:

    NAME-ps      pods NAME-ps-0 .. NAME-ps-(P-1)
    NAME-worker  pods NAME-worker-0 .. NAME-worker-(W-1); worker 0 is the chief

A StatefulSet pod is named <StatefulSet>-<ordinal>, and a headless
Service gives each pod the DNS name <pod>.<Service>. So every pod derives
the whole cluster from its own name (POD_NAME, set from metadata.name, else
HOSTNAME, which Kubernetes sets to the pod name) and the two counts
(--num_ps, --kubernetes_workers): ps i is NAME-ps-i.NAME-ps:PORT, worker
k is NAME-worker-k.NAME-worker:PORT. Nothing is exchanged.
"""

from collections.abc import Mapping
import os
import re
import signal
import time

from absl import logging

from trainer.cluster import spec as cluster_lib
from trainer.common.errors import UserError

SOURCE = "the Kubernetes pod name"  # "cluster from the Kubernetes pod name"
DEFAULT_PORT = 2222
_POD_NAME = re.compile(
    r"^(?P<name>[a-z0-9]([-a-z0-9]*[a-z0-9])?)-(?P<job>ps|worker)-"
    r"(?P<ordinal>[0-9]+)$")
_FIX = ("run the pods of deploy/kubernetes.yaml: StatefulSets NAME-ps and "
        "NAME-worker, each with a headless Service of the same name")


def pod_name(environ: Mapping[str, str]) -> str:
    """POD_NAME (the manifest sets it from metadata.name), else HOSTNAME."""
    name = environ.get("POD_NAME") or environ.get("HOSTNAME")
    if not name:
        raise UserError("--cluster=kubernetes: neither POD_NAME nor HOSTNAME "
                        f"is set, so this pod cannot tell its role; {_FIX}")
    return name


def task_from_pod(environ: Mapping[str, str], num_ps: int,
                  num_workers: int | None, port: int) -> cluster_lib.Task:
    """This pod's task and the whole cluster.

    Args:
      environ: the environment (POD_NAME or HOSTNAME: e.g. "mnist-worker-1").
      num_ps, num_workers: the replicas of NAME-ps and NAME-worker.
      port: the port every task listens on (each pod has its own address).
    Raises:
      UserError: a name not of the form NAME-ps-i / NAME-worker-i, a
        missing worker count, or an ordinal beyond the counts.
    """
    name = pod_name(environ)
    match = _POD_NAME.match(name)
    if not match:
        raise UserError(f"--cluster=kubernetes: pod name '{name}' is not "
                        f"NAME-ps-<i> or NAME-worker-<i>; {_FIX}")
    if num_workers is None or num_workers < 1:
        raise UserError("--cluster=kubernetes needs --kubernetes_workers=W, "
                        "the replicas of the worker StatefulSet (and "
                        "--num_ps, those of the ps one)")
    run = match["name"]

    def addresses(job: str, count: int) -> tuple[str, ...]:
        return tuple(f"{run}-{job}-{i}.{run}-{job}:{port}"
                     for i in range(count))

    where = f"--cluster=kubernetes (pod {name})"
    cluster = cluster_lib.make_cluster(addresses("ps", num_ps),
                                       addresses("worker", num_workers),
                                       where)
    job, ordinal = match["job"], int(match["ordinal"])
    size = num_ps if job == "ps" else num_workers
    if ordinal >= size:
        flag = "--num_ps" if job == "ps" else "--kubernetes_workers"
        raise UserError(f"{where}: ordinal {ordinal} is beyond {flag}="
                        f"{size}; give {flag} the StatefulSet's replicas")
    return cluster_lib.make_task(cluster, job, ordinal, SOURCE)


def hold_after_end(sleep=time.sleep) -> None:
    """Keeps a pod that finished training alive until it is deleted.

    A StatefulSet restarts every container that exits, even with status
    0, which would start the run over (the chief would evaluate it again,
    the ps would wait for a chief forever). So after a clean end the task
    sleeps; SIGTERM (the pod's deletion) ends it with status 0. A task
    that fails exits at once and is restarted: the recovery of
    docs/how-it-works.md#when-something-fails.
    """
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    logging.info("training ended; this pod stays up so that its "
                 "StatefulSet does not start it again: delete the run's "
                 "StatefulSets (kubectl delete -f deploy/kubernetes.yaml)")
    while True:
        sleep(3600)
