#!/usr/bin/env bash
# The whole test suite: installs test dependencies (idempotent), then formatting,
# lints, every unit and integration test of the workspace, then a check that nothing
# (node, namespace, process, mount) was left behind.
set -euo pipefail
cd "$(dirname "$0")/.."

started=$(mktemp)
trap 'rm -f "$started"' EXIT
scripts/install-deps.sh
scripts/install-kube.sh >/dev/null
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# Every test binary runs even after one fails, so a run reports every failure.
cargo test --workspace --locked --no-fail-fast
scripts/check-clean.sh "$started"
