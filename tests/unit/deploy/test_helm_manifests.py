"""What the rendered manifests say: the router discovers each worker tier, probes are gRPC health
checks, containers run as non-root, arguments parse with the real CLI parsers, and the dashboards
and rules shipped in the chart equal deploy/grafana and deploy/prometheus."""
from __future__ import annotations

import base64
import json
import subprocess

import pytest
from helpers.helm_chart import (CHART, CLUSTER_DOMAIN, CRD_KINDS, HELM_DIR, NAMESPACE,
                                PENDING_FLAGS, RENDERINGS, REPO_ROOT, WORKER_ROLE_FLAGS,
                                flag_value, main_container, of_kind, router_of, workloads)

yaml = pytest.importorskip("yaml")


# ---------------------------------------------------------------------------------------------
# what the manifests say


@pytest.mark.parametrize("name", RENDERINGS)
def test_router_discovers_each_tier_through_its_headless_service(rendered, name):
    _, docs = rendered[name]
    router_args = main_container(router_of(docs))["args"]
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    statefulsets = of_kind(docs, "StatefulSet")
    assert statefulsets
    seen_roles = set()
    for sts in statefulsets:
        args = main_container(sts)["args"]
        role = flag_value(args, "--role")
        seen_roles.add(role)
        port = int(flag_value(args, "--port"))
        service = services[sts["spec"]["serviceName"]]
        assert service["spec"]["clusterIP"] == "None"  # headless: per-pod DNS names
        assert service["spec"]["publishNotReadyAddresses"] is True
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert port in [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]
        expected = f"dns:///{service['metadata']['name']}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}:{port}"
        assert flag_value(router_args, WORKER_ROLE_FLAGS[role]) == expected
        assert float(flag_value(args, "--drain-delay-seconds")) > 0
        drain_seconds = float(flag_value(args, "--drain-delay-seconds")) \
            + float(flag_value(args, "--shutdown-grace-seconds"))
        assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_seconds
    assert seen_roles in ({"prefill", "decode"}, {"both"})
    for role, flag in WORKER_ROLE_FLAGS.items():
        assert (flag in router_args) == (role in seen_roles)


@pytest.mark.parametrize("name", RENDERINGS)
def test_probes_are_grpc_health_checks(rendered, name):
    _, docs = rendered[name]
    tls = name == "tls"
    for workload in workloads(docs):
        container = main_container(workload)
        grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        is_router = workload["kind"] == "Deployment"
        for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container[probe_name]
            if tls:  # kubelet's gRPC probe cannot speak TLS (values.yaml, tls)
                assert probe["tcpSocket"] == {"port": "grpc"}
                continue
            has_http = any(p["name"] == "http" for p in container["ports"])
            if is_router and probe_name == "readinessProbe" and has_http:  # cpu.yaml: httpPort
                assert set(probe) & {"grpc", "tcpSocket", "httpGet", "exec"} == {"httpGet"}
                assert probe["httpGet"] == {"path": "/health", "port": "http"}
                continue
            assert set(probe) & {"grpc", "tcpSocket", "httpGet", "exec"} == {"grpc"}
            assert probe["grpc"]["port"] == grpc_port
            expected_service = ("" if not is_router or probe_name == "readinessProbe"
                                 else "tandem.v1.Generate")
            assert probe["grpc"]["service"] == expected_service, (workload["kind"], probe_name)
        if not is_router:  # model loading: the startup probe allows at least 10 minutes
            startup = container["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("name, http_port", [("default", None), ("cpu", 8000), ("tls", 8443)])
def test_router_http_port_reaches_args_container_and_service(rendered, name, http_port):
    _, docs = rendered[name]
    router = router_of(docs)
    container = main_container(router)
    service = next(s for s in of_kind(docs, "Service")
                   if s["metadata"]["name"] == router["metadata"]["name"])
    http_ports = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    if http_port is None:
        assert "--http-port" not in container["args"] and not http_ports
        return
    assert flag_value(container["args"], "--http-port") == str(http_port)
    assert flag_value(container["args"], "--http-request-timeout-seconds") == (
        "600" if name == "cpu" else None)  # only where the values set it
    assert {"name": "http", "containerPort": http_port, "protocol": "TCP"} in container["ports"]
    assert http_ports == [{"name": "http", "port": http_port, "targetPort": "http",
                           "protocol": "TCP",
                           "appProtocol": "https" if name == "tls" else "http"}]


@pytest.mark.parametrize("name", RENDERINGS)
def test_containers_run_as_non_root(rendered, name):
    _, docs = rendered[name]
    for workload in workloads(docs):
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
    for workload in workloads(docs):
        container = main_container(workload)
        assert "command" not in container  # the image's entrypoint, `tandem`
        _parse_with_cli(container["args"])


def test_worker_advertises_its_pod_ip(rendered):
    """--host is also the source address of a prefill worker's KV handles: it must be the pod
    IP (reachable from decode pods), never 0.0.0.0 or localhost."""
    for _, docs in rendered.values():
        for sts in of_kind(docs, "StatefulSet"):
            container = main_container(sts)
            assert flag_value(container["args"], "--host") == "$(POD_IP)"
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
        statefulsets = of_kind(rendered[name][1], "StatefulSet")
        assert len(statefulsets) == len(roles), name
        for sts in statefulsets:
            container = main_container(sts)
            args = container["args"]
            resource, count, tp, ep, image_suffix = roles[flag_value(args, "--role")]
            limits = container["resources"].get("limits", {})
            gpu_limits = {k: v for k, v in limits.items() if k.endswith("/gpu")}
            assert gpu_limits == ({resource: count} if resource else {}), name
            assert flag_value(args, "--tensor-parallel-size") == tp, name
            assert ("--enable-expert-parallel" in args) == ep, name
            assert container["image"].endswith(image_suffix), (name, container["image"])
            volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
            assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"


def test_reliability_flags_only_when_set(rendered):
    """router.migrationLimit and <tier>.engine.kvPullFailure / maxStepStallSeconds render as
    their flags when set (nvidia-tp2 sets them); unset, the processes' defaults apply."""
    for name, (_, docs) in rendered.items():
        tp2 = name == "nvidia-tp2"
        (router,) = of_kind(docs, "Deployment")
        assert flag_value(main_container(router)["args"], "--migration-limit") == (
            "1" if tp2 else None), name
        assert flag_value(main_container(router)["args"], "--routing") == (
            "least-loaded" if tp2 else None), name
        assert flag_value(main_container(router)["args"], "--cache-weight") == (
            "4" if tp2 else None), name
        assert flag_value(main_container(router)["args"], "--local-prefill-max-tokens") == (
            "512" if tp2 else None), name
        for sts in of_kind(docs, "StatefulSet"):
            args = main_container(sts)["args"]
            is_set = tp2 and flag_value(args, "--role") == "decode"
            assert flag_value(args, "--kv-pull-failure") == ("fail" if is_set else None), name
            assert flag_value(args, "--max-step-stall-seconds") == ("20" if is_set else None)


def test_router_processes_flag(rendered):
    """router.processes renders as --processes (1 unless set; nvidia-tp2 sets 4)."""
    for name, (_, docs) in rendered.items():
        (router,) = of_kind(docs, "Deployment")
        assert flag_value(main_container(router)["args"], "--processes") == (
            "4" if name == "nvidia-tp2" else "1"), name


def test_tls_flags_and_mount_only_when_enabled(rendered):
    for name, (_, docs) in rendered.items():
        for workload in workloads(docs):
            pod = workload["spec"]["template"]["spec"]
            args = main_container(workload)["args"]
            mounts = {m["mountPath"] for m in main_container(workload)["volumeMounts"]}
            tls_volumes = [v for v in pod["volumes"] if v["name"] == "tls"]
            if name == "tls":
                assert flag_value(args, "--tls-cert") == "/etc/tandem/tls/tls.crt"
                assert flag_value(args, "--tls-key") == "/etc/tandem/tls/tls.key"
                assert flag_value(args, "--tls-ca") == "/etc/tandem/tls/ca.crt"
                assert "/etc/tandem/tls" in mounts
                assert tls_volumes[0]["secret"]["secretName"] == "tandem-tls"
            else:
                assert not any(a.startswith("--tls") for a in args), name
                assert "/etc/tandem/tls" not in mounts and not tls_volumes


def test_model_volume_and_default_model_init(rendered):
    for name, (_, docs) in rendered.items():
        for workload in workloads(docs):
            pod = workload["spec"]["template"]["spec"]
            model = flag_value(main_container(workload)["args"], "--model")
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
        budgets = of_kind(docs, "PodDisruptionBudget")
        pods = workloads(docs)
        assert len(budgets) == len(pods), name
        for budget in budgets:
            selector = budget["spec"]["selector"]["matchLabels"]
            matched = [w for w in pods
                       if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
            assert len(matched) == 1, (name, budget["metadata"]["name"])


def test_monitoring_objects(rendered):
    _, docs = rendered["cpu"]
    (monitor,) = of_kind(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    for service in of_kind(docs, "Service"):  # every Service has the port it scrapes
        assert monitor["spec"]["selector"]["matchLabels"].items() <= (
            service["metadata"]["labels"].items())
        assert "metrics" in [p["name"] for p in service["spec"]["ports"]]
    for workload in workloads(docs):
        container = main_container(workload)
        metrics_port = next(p["containerPort"] for p in container["ports"]
                            if p["name"] == "metrics")
        assert flag_value(container["args"], "--metrics-port") == str(metrics_port)
    assert not of_kind(rendered["default"][1], *CRD_KINDS)  # off unless asked for


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
    (config_map,) = [d for d in of_kind(docs, "ConfigMap")
                     if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    source = {p.name: json.loads(p.read_text())
              for p in (REPO_ROOT / "deploy" / "grafana").glob("*.json")}
    assert source and {k: json.loads(v) for k, v in config_map["data"].items()} == source
    total = sum(len(v.encode()) for v in config_map["data"].values())
    assert total < 900_000  # ConfigMaps hold at most 1 MiB (and the sidecar's annotation more)


def test_prometheus_rule_matches_deploy_prometheus(rendered):
    _, docs = rendered["cpu"]
    (rule,) = of_kind(docs, "PrometheusRule")
    source = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "tandem-rules.yaml").read_text())
    assert rule["spec"] == source


def test_internal_token_secret_is_mounted_and_passed_everywhere(rendered):
    for name, (_, docs) in rendered.items():
        secrets = of_kind(docs, "Secret")
        if name == "tls":  # internalToken.existingSecret: the chart makes none
            assert not secrets
            secret_name, key = "tandem-internal", "internal-token"
        else:
            (secret,) = secrets
            secret_name, key = secret["metadata"]["name"], "token"
            assert secret_name == "tandem-internal-token"
            assert len(base64.b64decode(secret["data"]["token"])) == 48
        for workload in workloads(docs):
            container = main_container(workload)
            assert flag_value(container["args"], "--internal-token-file") == \
                "/etc/tandem/internal-token/token", name
            mounts = {m["name"]: m for m in container["volumeMounts"]}
            assert mounts["internal-token"]["mountPath"] == "/etc/tandem/internal-token"
            volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
            source = volumes["internal-token"]["secret"]
            assert source["secretName"] == secret_name, name
            assert source["items"] == [{"key": key, "path": "token"}]


def test_network_policy_admits_workers_only_from_router_and_workers(rendered):
    for name, (_, docs) in rendered.items():
        policies = of_kind(docs, "NetworkPolicy")
        if name != "tls":
            assert not policies, f"{name}: the NetworkPolicy is off by default"
            continue
        (policy,) = policies
        spec = policy["spec"]
        worker_components = {"prefill", "decode", "both"}
        (selected,) = spec["podSelector"]["matchExpressions"]
        assert set(selected["values"]) == worker_components
        worker_pods = [w for w in workloads(docs) if
                       w["spec"]["template"]["metadata"]["labels"]
                       ["app.kubernetes.io/component"] in worker_components]
        assert worker_pods and all(w["kind"] == "StatefulSet" for w in worker_pods)
        router_rule, peer_rule, metrics_rule = spec["ingress"]
        (router_peer,) = router_rule["from"]
        assert router_peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == \
            "router"
        assert router_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
        (worker_peer,) = peer_rule["from"]
        assert set(worker_peer["podSelector"]["matchExpressions"][0]["values"]) == \
            worker_components
        assert metrics_rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
        assert metrics_rule["from"] == [{"namespaceSelector": {
            "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
        for workload in worker_pods:  # the named ports the rules admit exist on the pods
            ports = {p["name"] for p in main_container(workload)["ports"]}
            assert {"grpc", "metrics"} <= ports
