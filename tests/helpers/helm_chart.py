"""The Helm chart under test: paths, rendering, and lookups in rendered manifests."""
from __future__ import annotations

import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HELM_DIR = REPO_ROOT / "deploy" / "helm"
CHART = HELM_DIR / "tandem"
DOCKER = REPO_ROOT / "deploy" / "docker"
BAD_VALUES = sorted((REPO_ROOT / "tests" / "unit" / "deploy" / "bad_values").glob("*.yaml"))
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RENDERINGS = ["default", *(path.stem for path in CI_VALUES)]
RELEASE, NAMESPACE = "tandem", "tandem-ci"
CLUSTER_DOMAIN = "cluster.local"
# Custom resources kubernetes-validate has no schema for: it warns, and the test accepts that.
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion: native gRPC probes) and the
# newest kubernetes-validate knows (its default).
KUBE_VERSIONS = ["1.27", None]
# Flags the chart renders that the processes do not accept yet, with how many values each takes.
PENDING_FLAGS: dict[str, int] = {}
WORKER_ROLE_FLAGS = {"prefill": "--prefill", "decode": "--decode", "both": "--both"}


def values_args(name: str) -> list[str]:
    return [] if name == "default" else ["-f", str(CHART / "ci" / f"{name}.yaml")]


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)


def render_chart(helm: str, *args: str) -> subprocess.CompletedProcess:
    return run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)



def of_kind(docs: list[dict], *kinds: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] in kinds]


def workloads(docs):
    return of_kind(docs, "Deployment", "StatefulSet")


def router_of(docs) -> dict:
    (router,) = [d for d in of_kind(docs, "Deployment")
                 if d["metadata"]["labels"]["app.kubernetes.io/component"] == "router"]
    return router


def main_container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def flag_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None
