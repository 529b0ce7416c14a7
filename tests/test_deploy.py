"""deploy/: the manifests parse and agree with the trainer: flags it
knows, the ports it listens on, the StatefulSet names it derives
addresses from, a volume under the chief's --logdir and the data path,
restart policies that give the documented recovery; the Dockerfile runs
the trainer.

PyYAML (the test extra) parses the manifests: they are YAML, as kubectl
and the operator read them, and a parser of our own would test itself."""

import pathlib
import re

import pytest

from trainer import flags as trainer_flags
from trainer.cluster import kubernetes

yaml = pytest.importorskip("yaml", reason="PyYAML: pip install -e '.[test]'")

DEPLOY = pathlib.Path(__file__).resolve().parents[1] / "deploy"


def documents(name: str) -> dict:
    """kind/name -> the object, for each YAML document of deploy/<name>."""
    docs = list(yaml.safe_load_all((DEPLOY / name).read_text()))
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def flag_values(args: list[str]) -> dict:
    """--name=value / --name / --noname -> {name: value}, every name a
    trainer flag."""
    known = set(trainer_flags.trainer_flag_names())
    values = {}
    for arg in args:
        name, _, value = arg[2:].partition("=")
        if name not in known and name.startswith("no") and name[2:] in known:
            name, value = name[2:], "false"
        assert arg.startswith("--") and name in known, arg
        values[name] = value or "true"
    return values


def mounted_under(container: dict, path: str) -> bool:
    return any(path == m["mountPath"] or path.startswith(
        m["mountPath"].rstrip("/") + "/")
        for m in container.get("volumeMounts", []))


def container_of(template: dict) -> dict:
    (container,) = template["spec"]["containers"]
    return container


def test_tfjob_replicas_flags_ports_volumes_and_restarts():
    objects = documents("tfjob.yaml")
    job = objects["TFJob/mnist-ps"]
    replicas = job["spec"]["tfReplicaSpecs"]
    assert set(replicas) == {"Chief", "Worker", "PS"}
    for kind, spec in replicas.items():
        # Killed replicas (status >= 128) restart; exits 0, 1, 2 do not.
        assert spec["restartPolicy"] == "ExitCode", kind
        container = container_of(spec["template"])
        assert container["name"] == "tensorflow"     # the operator's rule
        assert [p["containerPort"] for p in container["ports"]] == [2222]
        flags = flag_values(container["args"])
        assert "cluster" not in flags        # TF_CONFIG gives the cluster
        if "data_dir" in flags:
            assert mounted_under(container, flags["data_dir"]), kind
    chief = container_of(replicas["Chief"]["template"])
    logdir = flag_values(chief["args"])["logdir"]
    assert mounted_under(chief, logdir)
    (runs,) = [v for v in replicas["Chief"]["template"]["spec"]["volumes"]
               if "persistentVolumeClaim" in v]
    assert f"PersistentVolumeClaim/{runs['persistentVolumeClaim']['claimName']}" \
        in objects


def test_statefulsets_match_the_names_the_pods_derive():
    objects = documents("kubernetes.yaml")
    sets = {k.split("/")[1]: v for k, v in objects.items()
            if k.startswith("StatefulSet/")}
    assert set(sets) == {"mnist-ps", "mnist-worker"}
    counts = {"ps": sets["mnist-ps"]["spec"]["replicas"],
              "worker": sets["mnist-worker"]["spec"]["replicas"]}
    for name, stateful in sets.items():
        service = objects[f"Service/{name}"]["spec"]
        assert stateful["spec"]["serviceName"] == name
        assert service["clusterIP"] == "None"
        assert service["publishNotReadyAddresses"] is True
        labels = stateful["spec"]["template"]["metadata"]["labels"]
        assert service["selector"] == labels
        container = container_of(stateful["spec"]["template"])
        flags = flag_values(container["args"])
        assert flags["cluster"] == "kubernetes"
        assert int(flags["num_ps"]) == counts["ps"]
        assert int(flags["kubernetes_workers"]) == counts["worker"]
        port = int(flags.get("kubernetes_port", kubernetes.DEFAULT_PORT))
        assert [p["containerPort"] for p in container["ports"]] == [port]
        assert [p["port"] for p in service["ports"]] == [port]
        (env,) = [e for e in container["env"] if e["name"] == "POD_NAME"]
        assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        # The pods' names as the StatefulSet makes them give these roles.
        job = name.rsplit("-", 1)[1]
        for ordinal in range(stateful["spec"]["replicas"]):
            task = kubernetes.task_from_pod(
                {"POD_NAME": f"{name}-{ordinal}"}, counts["ps"],
                counts["worker"], port)
            assert (task.job_name, task.task_index) == (job, ordinal)
            assert task.address == f"{name}-{ordinal}.{name}:{port}"
    workers = sets["mnist-worker"]["spec"]
    chief = container_of(workers["template"])
    flags = flag_values(chief["args"])
    assert mounted_under(chief, flags["logdir"])
    assert mounted_under(chief, flags["data_dir"])
    assert [t["metadata"]["name"] for t in workers["volumeClaimTemplates"]] \
        == ["runs"]


def test_dockerfile_installs_the_package_and_runs_a_task():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S+$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert re.search(r"pip install .*\s\.\s", text)
    assert 'ENTRYPOINT ["python", "-m", "trainer.main"]' in text
    # The data path the manifests pass is the image's default too.
    assert "MNIST_DATA_DIR=/data/mnist" in text
