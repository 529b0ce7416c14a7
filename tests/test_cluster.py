"""Cluster parsing: flags, TF_CONFIG, and every rejection before start-up."""

import json

import pytest

from trainer.cluster import spec as cluster
from trainer.common.errors import UserError

PS = "ps0.example.com:2222"
WORKERS = "w0.example.com:2222,w1.example.com:2222,10.0.0.7:2223"


def test_flags_give_cluster_and_role():
    task = cluster.from_flags("worker", 2, PS, WORKERS)
    assert task.cluster.ps == ("ps0.example.com:2222",)
    assert task.cluster.workers == ("w0.example.com:2222",
                                    "w1.example.com:2222", "10.0.0.7:2223")
    assert task.address == "10.0.0.7:2223"
    assert not task.is_chief
    assert task.source == "flags"
    assert cluster.from_flags("worker", 0, PS, WORKERS).is_chief
    assert not cluster.from_flags("ps", 0, PS, WORKERS).is_chief


def test_spaces_and_ipv6_are_accepted():
    task = cluster.from_flags("ps", 0, " [::1]:2222 ", "localhost:1, localhost:2")
    assert task.cluster.ps == ("[::1]:2222",)
    assert task.cluster.num_workers == 2


@pytest.mark.parametrize("job, index, message", [
    ("chief", 0, "unknown job 'chief'"),
    ("worker", 3, "task index 3 is out of range for job 'worker', which "
                  "has 3 task(s)"),
    ("worker", -1, "task index -1 is out of range"),
    ("ps", 1, "task index 1 is out of range for job 'ps'"),
])
def test_bad_role_is_rejected(job, index, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(
            ")", r"\)")):
        cluster.from_flags(job, index, PS, WORKERS)


@pytest.mark.parametrize("hosts, message", [
    ("localhost", "'localhost' is not host:port"),
    (":2222", "':2222' is not host:port"),
    ("localhost:", "port '' in 'localhost:' is not a number"),
    ("localhost:http", "port 'http' in 'localhost:http'"),
    ("localhost:0", "port '0' in 'localhost:0' is not a number from 1 to"),
    ("localhost:70000", "port '70000'"),
    ("bad host:2222", "'bad host' in 'bad host:2222' is not a valid host"),
])
def test_malformed_address_is_rejected_naming_the_flag(hosts, message):
    with pytest.raises(UserError, match="--ps_hosts") as error:
        cluster.from_flags("ps", 0, hosts, WORKERS)
    assert message in str(error.value)


def test_duplicate_address_is_rejected_naming_both_tasks():
    with pytest.raises(UserError, match="address LOCALHOST:2222 is used by "
                       "both ps 0 and worker 1"):
        cluster.from_flags("ps", 0, "localhost:2222",
                           "localhost:2223,LOCALHOST:2222")


def test_empty_jobs_are_rejected():
    with pytest.raises(UserError, match="no ps task"):
        cluster.from_flags("worker", 0, "", WORKERS)
    with pytest.raises(UserError, match="no worker task"):
        cluster.from_flags("ps", 0, PS, " , ")


def tf_config(cluster_def, task_type, index):
    return json.dumps({"cluster": cluster_def,
                       "task": {"type": task_type, "index": index}})


def test_tf_config_with_chief_numbers_chief_as_worker_zero():
    jobs = {"chief": ["c:1"], "worker": ["w:1", "w:2"], "ps": ["p:1", "p:2"]}
    chief = cluster.from_tf_config(tf_config(jobs, "chief", 0))
    assert chief.is_chief and chief.address == "c:1"
    assert chief.cluster.workers == ("c:1", "w:1", "w:2")
    assert chief.source == "TF_CONFIG"
    worker = cluster.from_tf_config(tf_config(jobs, "worker", 1))
    assert (worker.job_name, worker.task_index, worker.address) == (
        "worker", 2, "w:2")
    ps = cluster.from_tf_config(tf_config(jobs, "ps", 1))
    assert (ps.job_name, ps.task_index, ps.address) == ("ps", 1, "p:2")


def test_tf_config_master_is_the_chief_and_no_chief_means_worker_zero():
    jobs = {"master": ["m:1"], "worker": ["w:1"], "ps": ["p:1"]}
    assert cluster.from_tf_config(tf_config(jobs, "master", 0)).is_chief
    plain = {"worker": ["w:1", "w:2"], "ps": ["p:1"]}
    assert cluster.from_tf_config(tf_config(plain, "worker", 0)).is_chief


@pytest.mark.parametrize("text, message", [
    ("{not json", "TF_CONFIG is not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({"task": {"type": "ps", "index": 0}}), "has no 'cluster'"),
    (json.dumps({"cluster": {"ps": ["p:1"], "worker": ["w:1"]}}),
     "has no 'task'"),
    (tf_config({"ps": ["p:1"], "worker": ["w:1"]}, "evaluator", 0),
     "task type 'evaluator' is not a job in 'cluster'"),
    (tf_config({"ps": ["p:1"], "worker": ["w:1"], "evaluator": ["e:1"]},
               "worker", 0), "job(s) evaluator"),
    (tf_config({"ps": ["p:1"], "worker": ["w:1"]}, "worker", 1),
     "task index 1 is out of range"),
    (tf_config({"ps": ["p:1"], "chief": ["c:1"], "worker": ["w:1"]},
               "worker", 1), "task index 1 is out of range for job 'worker'"),
    (tf_config({"ps": ["p:1"], "chief": ["c:1", "c:2"]}, "chief", 0),
     "must list exactly one"),
    (tf_config({"ps": ["p:1"], "worker": ["w1"]}, "ps", 0),
     "'w1' is not host:port"),
    (tf_config({"ps": ["p:1"], "worker": ["w:1"]}, "ps", "0"),
     "task.index must be an integer"),
    (tf_config({"worker": ["w:1"]}, "worker", 0), "no ps task"),
])
def test_bad_tf_config_is_rejected(text, message):
    with pytest.raises(UserError) as error:
        cluster.from_tf_config(text)
    assert message in str(error.value)


def test_flags_win_over_tf_config():
    config = tf_config({"ps": ["p:1"], "worker": ["w:1"]}, "ps", 0)
    task = cluster.resolve("worker", 1, "a:1", "b:1,b:2", config)
    assert task.source == "flags" and task.address == "b:2"
    assert cluster.resolve(None, None, None, None, config).source == "TF_CONFIG"


def test_partial_flags_say_what_is_missing():
    with pytest.raises(UserError, match="--ps_hosts, --worker_hosts missing"):
        cluster.resolve("worker", 0, None, None, None)


def test_no_cluster_at_all_points_to_the_launcher():
    with pytest.raises(UserError, match="python -m trainer.launch"):
        cluster.resolve(None, None, None, None, None)
