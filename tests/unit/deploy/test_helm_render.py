"""deploy/helm/tandem renders and lints with every values file in its ci/ folder, every rendered
manifest passes `kubernetes-validate --strict`, and bad values fail naming the field."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.helm_chart import (BAD_VALUES, CHART, CRD_KINDS, HELM_DIR, KUBE_VERSIONS, NAMESPACE,
                                RENDERINGS, render_chart, run_helm, values_args)

yaml = pytest.importorskip("yaml")


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
    result = run_helm(helm, "lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                   *values_args(name))
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
    commands = [render_chart(helm, "-f", str(path))]
    if not re.search(r"^# template-only:", path.read_text(), re.MULTILINE):
        commands.append(run_helm(helm, "lint", str(CHART), "-f", str(path)))
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
    result = render_chart(helm, "--set", "decode.gpu.vendor=amd", "--set", "decode.gpu.count=4",
                       "--set", "decode.parallel.tensorParallelSize=8")
    assert result.returncode != 0 and "/decode/gpu/count" in result.stderr


def test_kernels_enum_matches_the_worker():
    from tandem.workers.ops.backend import KERNEL_CHOICES

    schema = json.loads((CHART / "values.schema.json").read_text())
    enum = schema["definitions"]["worker"]["properties"]["engine"]["properties"]["kernels"]["enum"]
    assert set(enum) == {"", *KERNEL_CHOICES}
