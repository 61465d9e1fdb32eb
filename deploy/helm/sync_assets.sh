#!/usr/bin/env bash
# Copies the repo's dashboards and Prometheus rules into the chart (helm reads only files inside
# the chart): deploy/grafana/*.json -> tandem/files/dashboards/, deploy/prometheus/tandem-rules.yaml
# -> tandem/files/prometheus/. Run it after changing either; tests/unit/deploy/test_helm_chart.py
# fails while the copies differ.
#
#   bash deploy/helm/sync_assets.sh           # copy
#   bash deploy/helm/sync_assets.sh --check   # exit 1, listing the differences, if out of date
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
DEPLOY="$(dirname "$HERE")"
CHART_FILES="$HERE/tandem/files"

check=0
case "${1:-}" in
    --check) check=1 ;;
    "") ;;
    *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

# pairs: source directory, glob, destination directory
sync() {
    local src_dir="$1" pattern="$2" dest_dir="$3" status=0 src name
    mkdir -p "$dest_dir"
    for src in "$src_dir"/$pattern; do
        name="$(basename "$src")"
        if [ "$check" = 1 ]; then
            if ! cmp -s "$src" "$dest_dir/$name"; then
                echo "out of date: ${dest_dir#"$DEPLOY/"}/$name (from ${src#"$DEPLOY/"})"
                status=1
            fi
        else
            cp "$src" "$dest_dir/$name"
        fi
    done
    # copies whose source is gone
    for dest in "$dest_dir"/$pattern; do
        [ -e "$dest" ] || continue
        name="$(basename "$dest")"
        if [ ! -e "$src_dir/$name" ]; then
            if [ "$check" = 1 ]; then
                echo "stale: ${dest#"$DEPLOY/"} (no ${src_dir#"$DEPLOY/"}/$name)"
                status=1
            else
                rm -f "$dest"
            fi
        fi
    done
    return $status
}

status=0
sync "$DEPLOY/grafana" "*.json" "$CHART_FILES/dashboards" || status=1
sync "$DEPLOY/prometheus" "tandem-rules.yaml" "$CHART_FILES/prometheus" || status=1
if [ "$check" = 1 ] && [ $status != 0 ]; then
    echo "run: bash deploy/helm/sync_assets.sh" >&2
fi
exit $status
