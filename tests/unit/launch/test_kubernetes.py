"""``mover-launch`` in a Kubernetes JobSet's pods: the hosts from the pod's environment (pure).

The environment contract (launch/kubernetes.py) as JobSet and the manifest set it: the hosts,
this pod's node rank, the controller's address and port, the spare hosts, and one clear error
for each contradiction; host flags win; Slurm's and a JobSet's variables together are refused.
Then examples/kubernetes/jobset.yaml, parsed: each pod template gets what the launcher reads,
the job's Secret, the preStop hook, a failure policy that leaves recovery to the job, and the
Service that selects the controller's pod; each pod's environment, as Kubernetes fills it in,
gives the launcher the job's hosts in order.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import pytest

from mover_plugin.errors import ConfigError
from mover_plugin.launch.config import parse_launch_args
from mover_plugin.launch.hosts import DEFAULT_MASTER_PORT, allocation_of, main
from mover_plugin.launch.job_secret import JOB_SECRET_ENV
from mover_plugin.launch.kubernetes import ANY_INTERFACE, allocation_from_env
from support.paths import ROOT

yaml = pytest.importorskip("yaml")

MANIFEST = ROOT / "examples" / "kubernetes" / "jobset.yaml"
LABELS = {"JOBSET_NAME": "jobset.sigs.k8s.io/jobset-name",
          "REPLICATED_JOB_NAME": "jobset.sigs.k8s.io/replicatedjob-name",
          "JOB_INDEX": "jobset.sigs.k8s.io/job-index"}
"""The variables a pod gets from its JobSet labels through the downward API."""
HOST_FLAGS = ("--hostfile", "--nnodes", "--node-rank", "--master-addr", "--standalone",
              "--spare-hosts", "--master-port")


def pod_env(replicated_job: str = "workers", index: int = 0, **more: str) -> dict[str, str]:
    """A pod's environment as JobSet, Kubernetes and the example manifest set it."""
    return {"JOBSET_NAME": "gpt", "REPLICATED_JOB_NAME": replicated_job, "JOB_INDEX": "0",
            "JOB_COMPLETION_INDEX": str(index), "MOVER_WORKERS": "workers:3",
            "MOVER_SPARES": "spares:2", JOB_SECRET_ENV: "jobset-test-secret-0123", **more}


HOSTS = ("gpt-workers-0-0.gpt", "gpt-workers-0-1.gpt", "gpt-workers-0-2.gpt",
         "gpt-spares-0-0.gpt", "gpt-spares-0-1.gpt")


@pytest.mark.parametrize("replicated_job, index, node_rank", [
    ("workers", 0, 0), ("workers", 2, 2), ("spares", 0, 3), ("spares", 1, 4)])
def test_a_pod_finds_the_hosts_and_its_node_rank(replicated_job, index, node_rank):
    allocation = allocation_from_env(pod_env(replicated_job, index))
    assert allocation.hosts == HOSTS and allocation.node_rank == node_rank
    assert allocation.spare_hosts == 2 and allocation.port is None
    assert allocation.master_addr == HOSTS[0] and allocation.listen_addr == ANY_INTERFACE


def test_the_controller_address_port_and_subdomain_come_from_the_manifest():
    allocation = allocation_from_env(pod_env(
        MOVER_MASTER_ADDR="gpt-controller", MOVER_MASTER_PORT="6000", MOVER_SUBDOMAIN="net",
        MOVER_SPARES=""))
    assert allocation.hosts == ("gpt-workers-0-0.net", "gpt-workers-0-1.net",
                                "gpt-workers-0-2.net")
    assert (allocation.master_addr, allocation.port, allocation.spare_hosts) == (
        "gpt-controller", 6000, 0)


def test_outside_a_jobset_pod_there_is_no_allocation():
    assert allocation_from_env({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) is None
    assert allocation_from_env({"JOBSET_NAME": " "}) is None


def test_without_host_flags_the_launch_takes_the_hosts_from_the_pod():
    config = parse_launch_args(["--policy", "resilient", "--nproc-per-node", "2", "train.py"],
                               sys.executable, pod_env("spares", 1, MOVER_MASTER_ADDR="ctl"))
    assert [(n.host, n.nproc, n.spare_slots, n.first_rank) for n in config.nodes] == [
        (HOSTS[0], 2, 0, 0), (HOSTS[1], 2, 0, 2), (HOSTS[2], 2, 0, 4), (HOSTS[3], 0, 2, 6),
        (HOSTS[4], 0, 2, 6)]
    assert (config.local_node_ranks, config.runs_controller, config.world_size) == ((4,),
                                                                                   False, 6)
    assert (config.master_addr, config.master_port, config.listen_addr) == (
        "ctl", DEFAULT_MASTER_PORT, ANY_INTERFACE)
    first = parse_launch_args(["--policy", "resilient", "--master-port", "7000",
                               "--spare-hosts", "2", "train.py"], sys.executable,
                              pod_env(MOVER_MASTER_PORT="6000"))
    assert (first.runs_controller, first.master_port, len(first.nodes)) == (True, 7000, 5)


def test_host_flags_win_over_the_pod():
    config = parse_launch_args(["--standalone", "--nproc-per-node", "2", "train.py"],
                               sys.executable, pod_env())
    assert [n.host for n in config.nodes] == ["127.0.0.1"] and config.listen_addr is None


BAD = [
    (pod_env(MOVER_WORKERS=""), "this pod is a JobSet's (JOBSET_NAME=gpt) but MOVER_WORKERS "
     "is not set: set it to the worker hosts' replicated job and their number, e.g. workers:4"),
    (pod_env(MOVER_WORKERS="workers"), "MOVER_WORKERS 'workers' is not REPLICATED_JOB:HOSTS "
     "with at least one host (e.g. workers:4)"),
    (pod_env(MOVER_SPARES="spares:0"), "MOVER_SPARES 'spares:0' is not REPLICATED_JOB:HOSTS"),
    (pod_env(MOVER_SPARES="workers:1"), "MOVER_SPARES 'workers:1' names the workers' "
     "replicated job (MOVER_WORKERS 'workers:3'); spare hosts need one of their own"),
    (pod_env("launcher"), "this pod's replicated job 'launcher' (REPLICATED_JOB_NAME) is not "
     "one of the job's hosts: 'workers' (MOVER_WORKERS) or 'spares' (MOVER_SPARES)"),
    (pod_env(JOB_INDEX="1"), "JOB_INDEX 1: mover-launch takes one Job per replicated job "
     "(replicas: 1), whose pods are the hosts; valid: 0"),
    (pod_env("spares", 2), "JOB_COMPLETION_INDEX 2 does not exist: replicated job 'spares' "
     "has 2 host(s) (MOVER_SPARES 'spares:2'), indexes 0..1"),
    (pod_env(JOB_COMPLETION_INDEX=""), "this pod is a JobSet's but JOB_COMPLETION_INDEX is "
     "not set: it comes from Kubernetes for the pods of an Indexed Job"),
    (pod_env(REPLICATED_JOB_NAME=""), "REPLICATED_JOB_NAME is not set: it comes from the "
     "pod's label jobset.sigs.k8s.io/replicatedjob-name through the downward API"),
    (pod_env(JOB_COMPLETION_INDEX="-1"), "JOB_COMPLETION_INDEX '-1' is not a whole number"),
    (pod_env(MOVER_MASTER_PORT="70000"), "MOVER_MASTER_PORT 70000 is not a port: valid "
     "1..65535"),
    ({**pod_env(), "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "0"},
     "this process runs both in a Slurm job step (SLURM_JOB_ID 42) and in a Kubernetes JobSet "
     "pod (JOBSET_NAME gpt): the hosts would come from both"),
]


@pytest.mark.parametrize("env, message", BAD)
def test_a_contradicting_pod_environment_stops_the_launch_with_one_clear_error(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_launch_args(["--policy", "resilient", "train.py"], sys.executable, env)


def test_spare_hosts_on_the_command_line_must_agree_with_the_pod():
    with pytest.raises(ConfigError, match=re.escape(
            "--spare-hosts 1 contradicts a Kubernetes JobSet pod (JOBSET_NAME is set), which "
            "has 2 spare host(s): drop the flag or give 2")):
        parse_launch_args(["--policy", "resilient", "--spare-hosts", "1", "train.py"],
                          sys.executable, pod_env())


def test_hosts_prints_what_a_hook_needs(capsys):
    assert main(pod_env("workers", 1, MOVER_MASTER_ADDR="ctl", MOVER_MASTER_PORT="6000")) == 0
    assert capsys.readouterr().out == f"1 {HOSTS[1]} ctl 6000 {HOSTS[0]}\n"
    assert main({}) == 2
    assert "neither a Slurm job step nor a Kubernetes JobSet pod" in capsys.readouterr().err


# -- the example manifests ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    documents = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    by_kind = {d["kind"]: d for d in documents}
    assert sorted(by_kind) == ["JobSet", "Secret", "Service"] and len(documents) == 3
    return by_kind


def _jobs(jobset: dict[str, Any]) -> list[dict[str, Any]]:
    return jobset["spec"]["replicatedJobs"]


def _container(job: dict[str, Any]) -> dict[str, Any]:
    (container,) = job["template"]["spec"]["template"]["spec"]["containers"]
    return container


def _values(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_every_pod_template_gets_what_the_launcher_reads(manifests):
    jobs = _jobs(manifests["JobSet"])
    assert [job["name"] for job in jobs] == ["workers", "spares"]
    values = [_values(_container(job)) for job in jobs]
    assert values[0] == values[1]
    assert values[0]["MOVER_WORKERS"] == "workers:2" and values[0]["MOVER_SPARES"] == "spares:1"
    for job in jobs:
        spec, container = job["template"]["spec"], _container(job)
        hosts = int(values[0]["MOVER_WORKERS" if job["name"] == "workers" else "MOVER_SPARES"]
                    .split(":")[1])
        assert job["replicas"] == 1 and spec["completionMode"] == "Indexed"
        assert spec["completions"] == spec["parallelism"] == hosts
        fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]
                  if "fieldRef" in e.get("valueFrom", {})}
        assert fields == {name: f"metadata.labels['{label}']" for name, label in LABELS.items()}
        assert container["command"] == ["mover-launch"]
        assert not set(HOST_FLAGS) & set(container["args"])
        assert container["args"] == _container(jobs[0])["args"]


def test_every_pod_takes_the_secret_and_runs_the_prestop_hook(manifests):
    secret = manifests["Secret"]
    assert JOB_SECRET_ENV in secret["stringData"]
    for job in _jobs(manifests["JobSet"]):
        pod, container = job["template"]["spec"]["template"]["spec"], _container(job)
        (ref,) = [e["valueFrom"]["secretKeyRef"] for e in container["env"]
                  if e["name"] == JOB_SECRET_ENV]
        assert ref == {"name": secret["metadata"]["name"], "key": JOB_SECRET_ENV}
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "bash" and command[1].endswith("/examples/kubernetes/prestop.sh")
        assert (ROOT / "examples" / "kubernetes" / "prestop.sh").exists()
        assert command[1].startswith(container["workingDir"] + "/")
        # the grace period covers the hook's bound, finding the job and the stop of the workers
        args = container["args"]
        stop_grace = float(args[args.index("--stop-grace-s") + 1])
        bound = float(_values(container)["MOVER_MIGRATE_TIMEOUT_S"])
        assert pod["terminationGracePeriodSeconds"] >= bound + 15 + stop_grace
        assert pod["restartPolicy"] == "Never"


def test_a_pod_failure_or_eviction_does_not_restart_the_jobset(manifests):
    jobset = manifests["JobSet"]["spec"]
    policy = jobset["failurePolicy"]
    assert policy["maxRestarts"] == 0
    assert [rule["action"] for rule in policy["rules"]] == ["FailJobSet"]
    for job in _jobs(manifests["JobSet"]):
        spec = job["template"]["spec"]
        assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in spec[
            "podFailurePolicy"]["rules"]
        assert spec["backoffLimit"] >= 1
    workers = _jobs(manifests["JobSet"])[0]["template"]["spec"]
    assert workers["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}
    assert jobset["successPolicy"] == {"operator": "Any", "targetReplicatedJobs": ["workers"]}


def test_the_headless_service_selects_the_controllers_pod(manifests):
    service, jobset = manifests["Service"], manifests["JobSet"]
    values = _values(_container(_jobs(jobset)[0]))
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {
        "jobset.sigs.k8s.io/jobset-name": jobset["metadata"]["name"],
        "jobset.sigs.k8s.io/replicatedjob-name": _jobs(jobset)[0]["name"],
        "jobset.sigs.k8s.io/job-index": "0",
        "batch.kubernetes.io/job-completion-index": "0"}
    assert values["MOVER_MASTER_ADDR"] == service["metadata"]["name"]
    (port,) = service["spec"]["ports"]
    assert port["port"] == port["targetPort"] == int(values["MOVER_MASTER_PORT"])


def test_each_pod_of_the_manifest_launches_as_its_host_of_the_job(manifests):
    """Each pod's environment, as Kubernetes fills it in from the manifest, gives the launcher
    the job's hosts in order: the workers, then the spare host, the first worker the
    controller."""
    jobset = manifests["JobSet"]
    name = jobset["metadata"]["name"]
    node_ranks = []
    for job in _jobs(jobset):
        container = _container(job)
        for index in range(job["template"]["spec"]["completions"]):
            labels = {"JOBSET_NAME": name, "REPLICATED_JOB_NAME": job["name"], "JOB_INDEX": "0"}
            env = {**_values(container), **labels, "JOB_COMPLETION_INDEX": str(index),
                   JOB_SECRET_ENV: "manifest-test-secret-0123"}
            allocation = allocation_of(env)
            node_ranks.append(allocation.node_rank)
            config = parse_launch_args(container["args"], sys.executable, env)
            assert config.runs_controller == (allocation.node_rank == 0)
            assert [n.host for n in config.nodes] == [
                f"{name}-workers-0-0.{name}", f"{name}-workers-0-1.{name}",
                f"{name}-spares-0-0.{name}"]
            assert [n.spare for n in config.nodes] == [False, False, True]
            assert config.world_size == 16 and config.policy == "resilient"
    assert node_ranks == [0, 1, 2]
