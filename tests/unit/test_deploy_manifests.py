"""The deployment files (compose/, k8s/) against the code they deploy.

No Docker engine or Kubernetes cluster runs here, so these parse every file and check the
structure that matters: KEDA watches exactly the Redis lists kombu fills, Redis keeps what
it is given, worker commands name queues that exist, every workload has resources and a
grace period, and every Secret or ConfigMap a workload reads is defined.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import yaml
from kombu.transport.redis import Channel
from redis.backoff import NoBackoff
from redis.retry import Retry

from agentbatch.core.options import BatchOptions
from agentbatch.distributed.workers.app import (
    INFERENCE_QUEUE,
    PRIORITY_STEPS,
    TOOLS_QUEUE,
    client_app,
)
from agentbatch.distributed.workers.app import TURN_TASK as _TURN_TASK
from tests.support.scratch import root as scratch_root
from tests.support.scratch import scratch_dir

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose"
K8S = REPO / "k8s"
QUEUES = {INFERENCE_QUEUE, TOOLS_QUEUE}


# --- helpers ------------------------------------------------------------------------------

def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@cache
def k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += load_all(path)
    return docs


def k8s_objects(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in k8s_docs() if d["kind"] == kind}


def kombu_list_names(queue: str) -> list[str]:
    """The Redis lists kombu's priority transport reads for ``queue``, one per step."""
    return [f"{queue}{Channel.sep}{step}" if step else queue for step in PRIORITY_STEPS]


def parse_conf(text: str) -> dict[str, str]:
    conf = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            conf[key.lower()] = value.strip()
    return conf


def option(argv: list[str], flag: str) -> str:
    assert flag in argv, (flag, argv)
    return argv[argv.index(flag) + 1]


def pod_containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    return workload["spec"]["template"]["spec"]["containers"]


def container_argv(container: dict[str, Any]) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def env_names(container: dict[str, Any]) -> set[str]:
    names = {e["name"] for e in container.get("env", [])}
    configmaps = k8s_objects("ConfigMap")
    for source in container.get("envFrom", []):
        names |= set(configmaps[source["configMapRef"]["name"]]["data"])
    return names


def compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


def worker_deployments() -> dict[str, dict[str, Any]]:
    return {name: d for name, d in k8s_objects("Deployment").items()
            if "worker" in container_argv(pod_containers(d)[0])}


# --- every file parses --------------------------------------------------------------------

def test_every_yaml_file_parses_and_k8s_objects_are_well_formed():
    files = sorted([*COMPOSE.glob("*.yml"), *COMPOSE.glob("*.yaml"), *K8S.glob("*.yaml")])
    assert {p.name for p in files} >= {"docker-compose.yml", "kustomization.yaml",
                                       "keda.yaml", "redis.yaml"}
    for path in files:
        docs = load_all(path)
        assert docs, path
        if path.parent == K8S:
            for doc in docs:
                assert {"apiVersion", "kind"} <= set(doc), (path, doc)
                if doc["kind"] != "Kustomization":
                    assert doc["metadata"]["name"], path


def test_kustomization_lists_every_manifest_but_the_secret_template():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml",
                                                        "secret.example.yaml"}
    assert set(kustomization["resources"]) == manifests
    assert "secret.example.yaml" not in kustomization["resources"]  # no placeholder secrets
    namespaces = k8s_objects("Namespace")
    assert list(namespaces) == [kustomization["namespace"]]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kubectl_kustomize_builds_offline():
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    names = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    assert ("ScaledObject", "inference-worker") in names
    # the \x06\x16 list names survive kustomize's re-serialisation byte for byte
    lists = [t["metadata"]["listName"] for d in rendered if d["kind"] == "ScaledObject"
             for t in d["spec"]["triggers"]]
    assert set(lists) == {n for q in QUEUES for n in kombu_list_names(q)}


# --- KEDA watches exactly kombu's priority lists ------------------------------------------

def test_kombu_list_names_match_kombus_own_naming():
    """Our formula against kombu's Channel._q_for_pri, so a kombu change is caught."""
    stub = SimpleNamespace(sep=Channel.sep, priority_steps=PRIORITY_STEPS)
    stub.priority = lambda p: Channel.priority(stub, p)
    for queue in QUEUES:
        assert kombu_list_names(queue) == [Channel._q_for_pri(stub, queue, step)
                                           for step in PRIORITY_STEPS]
    assert kombu_list_names("inference") == [
        "inference", "inference\x06\x163", "inference\x06\x166", "inference\x06\x169"]
    # workers that LPUSH task messages themselves must push to the same lists
    if importlib.util.find_spec("agentbatch.distributed.workers.envelope") is not None:
        from agentbatch.distributed.workers.envelope import queue_key

        for queue in QUEUES:
            assert [queue_key(queue, step) for step in PRIORITY_STEPS] == \
                kombu_list_names(queue)


def test_each_worker_pool_has_a_scaledobject_with_one_trigger_per_priority_list():
    scaled = k8s_objects("ScaledObject")
    workers = worker_deployments()
    assert set(workers) == {"inference-worker", "tool-worker"}
    assert {so["spec"]["scaleTargetRef"]["name"] for so in scaled.values()} == set(workers)
    auths = k8s_objects("TriggerAuthentication")
    for so in scaled.values():
        target = workers[so["spec"]["scaleTargetRef"]["name"]]
        container = pod_containers(target)[0]
        queue = option(container_argv(container), "--queues")
        assert queue in QUEUES
        triggers = so["spec"]["triggers"]
        assert all(t["type"] == "redis" for t in triggers)
        # EXACTLY kombu's lists, in step order, one trigger each
        assert [t["metadata"]["listName"] for t in triggers] == kombu_list_names(queue)
        for t in triggers:
            meta = t["metadata"]
            assert meta.get("databaseIndex", "0") == "0"  # the workers' URL ends in /0
            assert meta["addressFromEnv"] in env_names(container)  # KEDA reads the pod's env
            assert all(isinstance(v, str) for v in meta.values())  # metadata is string-only
            auth = auths[t["authenticationRef"]["name"]]
            refs = {r["parameter"]: (r["name"], r["key"])
                    for r in auth["spec"]["secretTargetRef"]}
            assert refs["password"] in secret_keys()
            assert refs["username"] == ("agentbatch-redis", "keda-username")
        # the formula adds up every trigger, so the HPA scales on the whole backlog
        modifiers = so["spec"]["advanced"]["scalingModifiers"]
        names = [t["name"] for t in triggers]
        assert len(set(names)) == len(names)
        assert set(re.findall(r"[A-Za-z_]\w*", modifiers["formula"])) == set(names)
        assert "+" in modifiers["formula"] and modifiers["target"]


def test_the_redis_address_keda_reads_is_the_fqdn_of_the_redis_service():
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    config = k8s_objects("ConfigMap")["agentbatch-config"]["data"]
    service = k8s_objects("Service")["redis"]
    port = service["spec"]["ports"][0]["port"]
    assert config["AGENTBATCH_REDIS_ADDRESS"] == \
        f"redis.{namespace}.svc.cluster.local:{port}"


@pytest.mark.redis
def test_kombu_really_fills_the_lists_keda_watches(redis_url):
    """Send one turn per priority step through Celery and look at the keys in Redis."""
    app = client_app(redis_url)
    for step in PRIORITY_STEPS:
        app.send_task(_TURN_TASK, args=["deploy-test", 0, 0, 1], queue=INFERENCE_QUEUE,
                      priority=step)
    r = redis.from_url(redis_url)
    keys = {k.decode() for k in r.keys(f"{INFERENCE_QUEUE}*")}
    watched = {t["metadata"]["listName"]
               for t in k8s_objects("ScaledObject")["inference-worker"]["spec"]["triggers"]}
    assert keys == watched
    assert all(r.llen(k) == 1 for k in keys)


# --- Redis keeps what it is given ---------------------------------------------------------

def compose_redis_conf() -> dict[str, str]:
    return parse_conf((COMPOSE / "redis.conf").read_text())


def k8s_redis_conf() -> dict[str, str]:
    return parse_conf(k8s_objects("ConfigMap")["redis-config"]["data"]["redis.conf"])


@pytest.mark.parametrize("conf", [compose_redis_conf, k8s_redis_conf],
                         ids=["compose", "k8s"])
def test_redis_conf_is_append_only_and_never_evicts(conf):
    c = conf()
    assert c["appendonly"] == "yes"
    assert c["appendfsync"] == "everysec"
    assert c["maxmemory-policy"] == "noeviction"
    assert c["dir"] == "/data"
    assert "requirepass" not in c  # the password comes from the environment


@pytest.mark.redis
@pytest.mark.parametrize("conf_text", [
    lambda: (COMPOSE / "redis.conf").read_text(),
    lambda: k8s_objects("ConfigMap")["redis-config"]["data"]["redis.conf"],
], ids=["compose", "k8s"])
def test_redis_server_accepts_the_conf(conf_text):
    """Start the real redis-server on each conf (dir/port/bind overridden for a sandbox)."""
    from tests.support.redis_server import free_port

    data = scratch_dir("conf-")
    port = free_port()
    text = re.sub(r"(?m)^dir .*$", f"dir {data}", conf_text())
    (data / "redis.conf").write_text(text)
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server",
                             str(data / "redis.conf"), "--port", str(port),
                             "--bind", "127.0.0.1", "--requirepass", "pw",
                             "--logfile", str(data / "log")])
    try:
        client = redis.Redis(port=port, password="pw", socket_connect_timeout=0.2)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, (data / "log").read_text()
                time.sleep(0.05)
        got = {k: client.config_get(k)[k] for k in
               ("appendonly", "appendfsync", "maxmemory-policy", "save")}
        assert got == {"appendonly": "yes", "appendfsync": "everysec",
                       "maxmemory-policy": "noeviction", "save": ""}
        client.set("k", "v")
        assert (data / "appendonlydir").is_dir()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="wrong", retry=Retry(NoBackoff(), 0)).ping()
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(data, ignore_errors=True)


def test_k8s_redis_persists_to_a_claimed_volume_with_the_password_from_a_secret():
    sts = k8s_objects("StatefulSet")["redis"]
    container = pod_containers(sts)[0]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    assert mounts["data"] == k8s_redis_conf()["dir"] and "data" in claims
    argv = container_argv(container)
    assert "--requirepass" not in argv  # the default user's password is in the ACL file
    assert "--aclfile /run/redis-acl/users.acl" in argv[-1]
    assert mounts["acl"] == "/run/redis-acl"
    assert "REDIS_PASSWORD" in env_names(container)
    assert sts["spec"]["serviceName"] in k8s_objects("Service")


def test_compose_redis_uses_the_conf_a_volume_and_a_password_from_the_env():
    redis_svc = compose()["services"]["redis"]
    assert any(v.startswith("./redis.conf:") for v in redis_svc["volumes"])
    data = [v for v in redis_svc["volumes"] if v.endswith(":/data")]
    assert data and data[0].split(":")[0] in compose()["volumes"]  # a named volume
    command = redis_svc["command"]
    assert command[:2] == ["sh", "-c"] and "--requirepass" not in command[2]
    assert "redis-server /usr/local/etc/redis/redis.conf --aclfile /data/users.acl" \
        in command[2]
    assert redis_svc["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD")


# --- workers ------------------------------------------------------------------------------

def test_compose_workers_use_existing_queues_and_every_service_has_a_healthcheck():
    services = compose()["services"]
    assert set(services) == {"redis", "sim", "inference-worker", "tool-worker", "flower"}
    for name, svc in services.items():
        assert "healthcheck" in svc, name
    inference = services["inference-worker"]["command"]
    tools = services["tool-worker"]["command"]
    assert inference[:2] == tools[:2] == ["agentbatch", "worker"]
    assert option(inference, "--queues") == INFERENCE_QUEUE
    assert option(tools, "--queues") == TOOLS_QUEUE
    assert option(inference, "--concurrency") == "32"
    assert services["inference-worker"]["deploy"]["replicas"] >= 1
    for svc in ("inference-worker", "tool-worker"):
        port = option(services[svc]["command"], "--metrics-port")
        assert f":{port}/metrics" in " ".join(services[svc]["healthcheck"]["test"])
        assert services[svc]["environment"]["AGENTBATCH_REDIS_URL"].startswith("redis://")
    sim = services["sim"]["command"]
    assert sim[:2] == ["agentbatch", "sim"] and option(sim, "--host") == "0.0.0.0"


def test_compose_flower_and_env_example():
    flower = compose()["services"]["flower"]
    command = " ".join(flower["command"])
    assert command == "agentbatch flower --port 5555 --address 0.0.0.0"
    assert "--broker" not in command and "--redis-url" not in command  # no password in argv
    assert flower["ports"] == ["127.0.0.1:${FLOWER_HOST_PORT:-5555}:5555"]
    assert flower["environment"]["AGENTBATCH_REDIS_URL"].startswith("redis://")
    assert flower["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH")
    assert "args" in flower["environment"]["FLOWER_TASKS_COLUMNS"].split(",")
    # every variable the compose file requires (${X:?...}) is in .env.example
    text = (COMPOSE / "docker-compose.yml").read_text()
    required = set(re.findall(r"\$\{(\w+):\?", text))
    example = {line.split("=", 1)[0] for line in (COMPOSE / ".env.example").read_text()
               .splitlines() if "=" in line and not line.startswith("#")}
    assert required == {"REDIS_PASSWORD", "FLOWER_BASIC_AUTH", "REDIS_WORKER_PASSWORD",
                        "REDIS_FLOWER_PASSWORD", "REDIS_SUBMITTER_PASSWORD"}
    assert required <= example
    assert ".env" in (COMPOSE / ".gitignore").read_text().split()


def test_dockerfile_installs_the_package_as_a_non_root_user():
    text = (COMPOSE / "Dockerfile").read_text()
    assert re.search(r"(?m)^FROM python:3\.11-slim$", text)
    assert 'pip install ".[all]"' in text
    users = re.findall(r"(?m)^USER (\S+)$", text)
    assert users and users[-1].split(":")[0] not in ("root", "0")


def test_k8s_workers_use_existing_queues_expose_metrics_and_shut_down_warm():
    workers = worker_deployments()
    turn_timeout = BatchOptions.__dataclass_fields__["timeout_per_turn"].default
    tool_timeout = BatchOptions.__dataclass_fields__["timeout_per_tool"].default
    for name, deployment in workers.items():
        spec = deployment["spec"]
        assert "replicas" not in spec, "KEDA owns the replica count"
        pod = spec["template"]
        container = pod_containers(deployment)[0]
        argv = container_argv(container)
        queue = option(argv, "--queues")
        assert queue in QUEUES
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        longest = turn_timeout if queue == INFERENCE_QUEUE else tool_timeout
        assert grace > longest, (name, grace, longest)
        # Prometheus scrapes the port the worker serves metrics on
        port = option(argv, "--metrics-port")
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == port
        assert annotations["prometheus.io/path"] == "/metrics"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == int(port)
        assert container["livenessProbe"]["tcpSocket"]["port"] in ("metrics", int(port))
        # the Redis URL is assembled from the Secret and the ConfigMap
        url = next(e for e in container["env"] if e["name"] == "AGENTBATCH_REDIS_URL")
        for var in re.findall(r"\$\((\w+)\)", url["value"]):
            assert var in env_names(container)
        assert url["value"].startswith("redis://") and url["value"].endswith("/0")


def test_every_workload_has_resources_and_a_grace_period():
    workloads = [*k8s_objects("Deployment").values(), *k8s_objects("StatefulSet").values()]
    assert len(workloads) == 4
    for workload in workloads:
        name = workload["metadata"]["name"]
        assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 0
        for container in pod_containers(workload):
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), name
            assert "memory" in resources["limits"], name
            assert "livenessProbe" in container, name


# --- Secrets and ConfigMaps ---------------------------------------------------------------

def secret_keys() -> set[tuple[str, str]]:
    keys = set()
    for secret in load_all(K8S / "secret.example.yaml"):
        assert secret["kind"] == "Secret"
        keys |= {(secret["metadata"]["name"], k) for k in secret["stringData"]}
    return keys


def test_every_secret_and_configmap_a_workload_reads_is_defined():
    configmaps = k8s_objects("ConfigMap")
    for workload in [*k8s_objects("Deployment").values(), *k8s_objects("StatefulSet").values()]:
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert (ref["name"], ref["key"]) in secret_keys(), ref
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in configmaps
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps


def test_flower_deployment_uses_basic_auth_from_a_secret_and_a_service():
    flower = k8s_objects("Deployment")["flower"]
    container = pod_containers(flower)[0]
    argv = container_argv(container)
    assert argv[:2] == ["agentbatch", "flower"]  # auth required, no silent broker default
    assert option(argv, "--port") == "5555" and option(argv, "--address") == "0.0.0.0"
    env = {e["name"]: e for e in container["env"]}
    assert env["FLOWER_BASIC_AUTH"]["valueFrom"]["secretKeyRef"]["name"] == "agentbatch-flower"
    assert "FLOWER_UNAUTHENTICATED_API" not in env
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthcheck"
    service = k8s_objects("Service")["flower"]
    assert service["spec"]["selector"] == flower["spec"]["selector"]["matchLabels"]
    assert flower["spec"]["replicas"] == 1  # Flower's task history is in memory


def test_batch_option_defaults_used_above_exist():
    names = {f.name for f in dataclasses.fields(BatchOptions)}
    assert {"timeout_per_turn", "timeout_per_tool"} <= names


# --- Redis ACL users: one template (deploy/redis-users.acl), used everywhere --------------

DEPLOY = REPO / "deploy"
ROLE_USERS = {"ADMIN": "default", "SUBMITTER": "agentbatch-submitter",
              "WORKER": "agentbatch-worker", "FLOWER": "agentbatch-flower",
              "KEDA": "agentbatch-keda"}


def acl_rules() -> dict[str, str]:
    """User name -> its rule line, from the template."""
    return {line.split()[1]: line for line in (DEPLOY / "redis-users.acl").read_text()
            .splitlines() if line.startswith("user ")}


def url_user(url: str) -> str:
    return url.split("://", 1)[1].split(":", 1)[0]


def env_value(container: dict[str, Any], name: str) -> str:
    return next(e["value"] for e in container["env"] if e["name"] == name)


def render_acl(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # the file holds passwords: under the test process's scratch dir, removed at exit
    out = scratch_dir("acl-") / "users.acl"
    return subprocess.run(["sh", str(DEPLOY / "render-redis-acl.sh"),
                           str(DEPLOY / "redis-users.acl"), str(out)],
                          env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                          text=True, timeout=30)


def test_the_acl_template_has_each_role_least_privilege_and_k8s_carries_it_verbatim():
    rules = acl_rules()
    assert set(rules) == set(ROLE_USERS.values())
    for user, line in rules.items():
        assert f"><{next(r for r, u in ROLE_USERS.items() if u == user)}_PASSWORD>" in line
        if user != "default":
            for rule in ("resetkeys", "resetchannels", "-@all"):
                assert f" {rule} " in f" {line} ", (user, rule)
            if "+@" in line:  # categories granted: the dangerous ones taken back
                assert " -@dangerous -@admin " in line, user
            assert " ~* " not in line and "+@all" not in line and " &* " not in line
    data = k8s_objects("ConfigMap")["redis-config"]["data"]
    assert data["users.acl.template"] == (DEPLOY / "redis-users.acl").read_text()
    assert data["render-redis-acl.sh"] == (DEPLOY / "render-redis-acl.sh").read_text()


def test_the_submitter_pushes_only_and_the_worker_cannot_publish_remote_control():
    """Issue 21, items 9 and 14, in the template: the submitter's root rules read only; each
    write command it has is tied to its keys by a selector (queues: LPUSH; batch keys:
    RENAMENX); the worker may not PUBLISH on the pidbox channel."""
    submitter = acl_rules()["agentbatch-submitter"]
    root, *selectors = submitter.split(" (")
    assert "%R~ab:*" in root.split() and "~ab:*" not in root.split()
    assert not {"+@write", "+@keyspace", "+@all", "+set", "+del", "+eval"} & set(root.split())
    queues = next(s for s in selectors if "inference*" in s)
    assert queues.rstrip(")").split() == ["%W~inference*", "%W~tools*", "+lpush"]
    batch = next(s for s in selectors if "~ab:{*}:plan" in s)
    assert [w for w in batch.rstrip(")").split() if w.startswith("+")] == ["+renamenx"]
    worker = acl_rules()["agentbatch-worker"]
    root, *selectors = worker.split(" (")
    assert " -publish " in f" {root} " and all("pidbox" not in s for s in selectors)


def test_redis_loads_the_acl_file_with_a_password_for_each_role():
    redis_svc = compose()["services"]["redis"]
    assert "../deploy/redis-users.acl:/usr/local/etc/redis/users.acl.template:ro" \
        in redis_svc["volumes"]
    assert "../deploy/render-redis-acl.sh:/usr/local/etc/redis/render-redis-acl.sh:ro" \
        in redis_svc["volumes"]
    assert "render-redis-acl.sh /usr/local/etc/redis/users.acl.template /data/users.acl" \
        in redis_svc["command"][2]
    # compose runs no KEDA: its user is left out of the rendered file
    assert set(redis_svc["environment"]) >= {"REDIS_PASSWORD", "REDIS_SUBMITTER_PASSWORD",
                                             "REDIS_WORKER_PASSWORD", "REDIS_FLOWER_PASSWORD"}
    sts = k8s_objects("StatefulSet")["redis"]
    container = pod_containers(sts)[0]
    assert "render-redis-acl.sh /etc/redis/users.acl.template /run/redis-acl/users.acl" \
        in container_argv(container)[-1]
    names = {e["name"] for e in container["env"]}
    assert names >= {"REDIS_PASSWORD", *(f"REDIS_{r}_PASSWORD" for r in ROLE_USERS
                                         if r != "ADMIN")}
    acl = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "acl")
    assert acl["emptyDir"]["medium"] == "Memory"  # rendered passwords never touch a disk


def test_every_redis_client_logs_in_as_its_own_acl_user():
    rules = acl_rules()
    services = compose()["services"]
    deployments = k8s_objects("Deployment")
    for name, user in (("inference-worker", "agentbatch-worker"),
                       ("tool-worker", "agentbatch-worker"), ("flower", "agentbatch-flower")):
        assert user in rules
        assert url_user(services[name]["environment"]["AGENTBATCH_REDIS_URL"]) == user, name
        container = pod_containers(deployments[name])[0]
        assert url_user(env_value(container, "AGENTBATCH_REDIS_URL")) == user, name
    secrets = {s["metadata"]["name"]: s["stringData"]
               for s in load_all(K8S / "secret.example.yaml")}
    assert secrets["agentbatch-redis"]["keda-username"] == "agentbatch-keda"


def test_the_acl_renderer_fills_drops_and_refuses():
    ok = render_acl({"REDIS_PASSWORD": "a1", "REDIS_WORKER_PASSWORD": "w-2.x_~"})
    assert ok.returncode == 0, ok.stderr
    out = Path(ok.args[-1])
    text = out.read_text()
    assert "#" not in text and "\n\n" not in text  # an ACL file has no comment syntax
    assert {line.split()[1] for line in text.splitlines()} == {"default", "agentbatch-worker"}
    assert ">a1 " in text and ">w-2.x_~ " in text and "_PASSWORD>" not in text
    assert out.stat().st_mode & 0o077 == 0  # readable by its owner only
    assert out.is_relative_to(scratch_root())  # removed with it when the process exits
    missing = render_acl({"REDIS_WORKER_PASSWORD": "w"})
    assert missing.returncode != 0 and "REDIS_PASSWORD" in missing.stderr
    bad = render_acl({"REDIS_PASSWORD": "a1", "REDIS_FLOWER_PASSWORD": "p/w&x"})
    assert bad.returncode == 2 and "REDIS_FLOWER_PASSWORD" in bad.stderr
    assert "p/w&x" not in bad.stderr


@pytest.mark.redis
def test_redis_server_starts_on_the_k8s_conf_with_the_rendered_acl():
    """The k8s redis.conf plus the rendered ACL file, as the StatefulSet starts them."""
    from tests.support.redis_server import free_port

    passwords = {"REDIS_PASSWORD": "adm1n", "REDIS_WORKER_PASSWORD": "w0rker",
                 "REDIS_KEDA_PASSWORD": "k3da"}
    rendered = render_acl(passwords)
    assert rendered.returncode == 0, rendered.stderr
    data = scratch_dir("conf-acl-")
    port = free_port()
    text = re.sub(r"(?m)^dir .*$", f"dir {data}", k8s_redis_conf_text())
    (data / "redis.conf").write_text(text)
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server",
                             str(data / "redis.conf"), "--port", str(port), "--bind",
                             "127.0.0.1", "--aclfile", rendered.args[-1],
                             "--logfile", str(data / "log")])
    try:
        admin = redis.Redis(port=port, password="adm1n", socket_connect_timeout=0.2)
        for _ in range(100):
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, (data / "log").read_text()
                time.sleep(0.05)
        assert redis.Redis(port=port, username="agentbatch-worker", password="w0rker").ping()
        keda = redis.Redis(port=port, username="agentbatch-keda", password="k3da")
        assert keda.llen("inference") == 0
        with pytest.raises(redis.exceptions.NoPermissionError):
            keda.get("ab:batches")
        with pytest.raises(redis.AuthenticationError):  # no password given: no such user
            redis.Redis(port=port, username="agentbatch-submitter", password="x",
                        retry=Retry(NoBackoff(), 0)).ping()
        with pytest.raises(redis.exceptions.RedisError):  # no anonymous access
            redis.Redis(port=port, retry=Retry(NoBackoff(), 0)).get("ab:batches")
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(data, ignore_errors=True)


def k8s_redis_conf_text() -> str:
    return k8s_objects("ConfigMap")["redis-config"]["data"]["redis.conf"]


def test_k8s_ports_open_to_the_network_are_limited_by_a_network_policy():
    """A worker's metrics and Flower listen on 0.0.0.0 in k8s (the default is 127.0.0.1),
    so a NetworkPolicy must decide who reaches those ports, and kustomize must apply it."""
    policies = k8s_objects("NetworkPolicy")
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert "network-policy.yaml" in listed
    covered: dict[str, set[int]] = {}
    for policy in policies.values():
        selector = policy["spec"]["podSelector"]
        names = set(selector.get("matchLabels", {}).values())
        for expr in selector.get("matchExpressions", []):
            assert expr["key"] == "app.kubernetes.io/name" and expr["operator"] == "In"
            names |= set(expr["values"])
        assert "Ingress" in policy["spec"]["policyTypes"]
        for rule in policy["spec"]["ingress"]:
            assert rule["from"], "an ingress rule with no source would admit everyone"
            for name in names:
                covered.setdefault(name, set()).update(p["port"] for p in rule["ports"])
    for deployment in k8s_objects("Deployment").values():
        name = deployment["metadata"]["labels"]["app.kubernetes.io/name"]
        argv = container_argv(pod_containers(deployment)[0])
        if "--metrics-port" in argv:
            assert option(argv, "--metrics-host") == "0.0.0.0"
            assert int(option(argv, "--metrics-port")) in covered.get(name, set()), name
        if "--address" in argv:
            assert int(option(argv, "--port")) in covered.get(name, set()), name
    assert 6379 in covered["redis"]


# --- validated against the Kubernetes, KEDA and Compose schemas, offline (issue 25) -------

SCHEMAS = Path(__file__).parent / "schemas"  # see schemas/README.md for where each is from
KEDA_KINDS = ("ScaledObject", "TriggerAuthentication")


def _k8s_definitions() -> Any:
    """Kubernetes' own definitions (ObjectMeta, HPA behavior) from kubernetes-validate."""
    import importlib.resources
    import json

    from kubernetes_validate.utils import latest_version

    path = (importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema" /
            f"v{latest_version()}-local-strict" / "_definitions.json")
    return json.loads(path.read_text())


def keda_errors(doc: dict[str, Any]) -> list[str]:
    """Where ``doc`` breaks the KEDA schema (schemas/keda-v1alpha1.json)."""
    import json

    import jsonschema
    from referencing import Registry, Resource

    keda = json.loads((SCHEMAS / "keda-v1alpha1.json").read_text())
    registry = Resource.from_contents(_k8s_definitions()) @ Registry()
    validator = jsonschema.Draft202012Validator({**keda, "$ref": f"#/$defs/{doc['kind']}"},
                                               registry=registry)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)]


def k8s_errors(doc: dict[str, Any]) -> str | None:
    """kubernetes-validate's strict verdict on ``doc`` (unknown fields refused)."""
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    try:
        kubernetes_validate.validate(doc, latest_version(), strict=True)
    except kubernetes_validate.ValidationError as exc:
        return str(exc)
    return None


def test_every_k8s_object_validates_against_the_kubernetes_schemas():
    checked = [d for d in k8s_docs() if d["kind"] not in KEDA_KINDS]
    assert {d["kind"] for d in checked} >= {"Deployment", "StatefulSet", "Service",
                                            "ConfigMap", "Secret", "NetworkPolicy"}
    errors = {f"{d['kind']}/{d['metadata']['name']}": k8s_errors(d) for d in checked}
    assert {k: e for k, e in errors.items() if e} == {}
    # the check is not vacuous: a misspelt field is refused
    broken = {**worker_deployments()["inference-worker"]}
    broken["spec"] = {**broken["spec"], "replica": 2}
    assert k8s_errors(broken) is not None


def test_every_keda_object_validates_against_the_keda_schema():
    keda = [d for d in k8s_docs() if d["kind"] in KEDA_KINDS]
    assert sorted(d["kind"] for d in keda) == ["ScaledObject", "ScaledObject",
                                               "TriggerAuthentication"]
    assert {f"{d['kind']}/{d['metadata']['name']}": keda_errors(d) for d in keda} == \
        {f"{d['kind']}/{d['metadata']['name']}": [] for d in keda}
    # not vacuous: a misspelt field, a number where KEDA wants a string, a bad HPA policy
    scaled = k8s_objects("ScaledObject")["inference-worker"]
    spec = scaled["spec"]
    assert keda_errors({**scaled, "spec": {**spec, "minReplicas": 1}})
    trigger = spec["triggers"][0]
    bad_trigger = {**trigger, "metadata": {**trigger["metadata"], "listLength": 16}}
    assert keda_errors({**scaled, "spec": {**spec, "triggers": [bad_trigger]}})
    advanced = {**spec["advanced"], "horizontalPodAutoscalerConfig": {
        "behavior": {"scaleDown": {"policies": [{"type": "Percent", "value": 50}]}}}}
    assert keda_errors({**scaled, "spec": {**spec, "advanced": advanced}})


def test_the_pools_scale_independently_with_graceful_local_probes():
    """One Deployment and one ScaledObject per pool; no probe runs `celery inspect`/`ping`
    (a broadcast over the broker to every worker) or any command at all: the probes are
    local TCP/HTTP checks of the pod's own port."""
    workers = worker_deployments()
    scaled = k8s_objects("ScaledObject")
    targets = [so["spec"]["scaleTargetRef"]["name"] for so in scaled.values()]
    assert sorted(targets) == sorted(workers) and len(set(targets)) == len(targets)
    queues = {name: option(container_argv(pod_containers(d)[0]), "--queues")
              for name, d in workers.items()}
    assert sorted(queues.values()) == sorted(QUEUES)  # each pool reads one queue only
    for workload in [*k8s_objects("Deployment").values(), *k8s_objects("StatefulSet").values()]:
        for container in pod_containers(workload):
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = container.get(kind)
                if probe is None:
                    continue
                text = yaml.safe_dump(probe)
                assert "inspect" not in text and "celery" not in text, (kind, probe)
                if workload["metadata"]["name"] in workers:
                    assert "exec" not in probe, (kind, probe)


def _compose_schema() -> dict[str, Any]:
    import json

    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    # the top-level project name joined the Compose spec after this schema (2021) was cut
    schema["properties"]["name"] = {"type": "string", "pattern": "^[a-z0-9][a-z0-9_-]*$"}
    return schema


def test_the_compose_file_validates_against_the_compose_spec():
    import jsonschema

    validator = jsonschema.Draft201909Validator(_compose_schema())  # its "$schema"
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(compose())]
    assert errors == []
    broken = {**compose(), "services": {**compose()["services"]}}
    broken["services"]["redis"] = {**broken["services"]["redis"], "restart_policy": "always"}
    assert list(validator.iter_errors(broken))  # not vacuous: an unknown key is refused


def _dockerfile_copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context (not --from=stage)."""
    copies = []
    for line in (COMPOSE / "Dockerfile").read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
            args = [p for p in parts[1:] if not p.startswith("--")]
            copies.append((args[:-1], args[-1]))
    return copies


def test_the_dockerfile_builds_the_package_as_installed_from_the_checkout(tmp_path):
    """No Docker engine here, so the image build itself cannot run: the same build context
    (what the COPY lines take, less the .dockerignore's exclusions) is built into a wheel
    with pip, and the wheel holds every file of the package git tracks."""
    text = (COMPOSE / "Dockerfile").read_text()
    workdir = re.findall(r"(?m)^WORKDIR (\S+)$", text)[0]
    context = tmp_path / workdir.strip("/")
    for sources, dest in _dockerfile_copies():
        context.mkdir(parents=True, exist_ok=True)
        for source in sources:
            into_dir = dest.endswith("/") or dest == "." or len(sources) > 1
            target = context / (Path(source).name if into_dir else dest)
            path = REPO / source
            if path.is_dir():
                shutil.copytree(path, target, ignore=shutil.ignore_patterns(
                    "__pycache__", "*.pyc"))
            else:
                shutil.copy(path, target)
    ignore = (COMPOSE / "Dockerfile.dockerignore").read_text().split()
    copied = {str(p.relative_to(context)).split("/")[0] for p in context.iterdir()}
    assert all(f"!{name}" in ignore or f"!{name}/" in ignore for name in copied), copied
    assert re.search(r'pip install "\.\[all\]"', text)  # installs the copied checkout
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
                          str(context)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import zipfile

    (wheel,) = (tmp_path / "dist").glob("agentbatch-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", "agentbatch"], cwd=REPO, capture_output=True,
                             text=True, timeout=60).stdout.split()
    assert tracked
    missing = [f for f in tracked if f not in in_wheel and not f.endswith(".pyc")]
    assert missing == [], missing
