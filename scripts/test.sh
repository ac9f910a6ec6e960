#!/usr/bin/env bash
# The whole test suite: installs test dependencies (idempotent), then formatting,
# lints, and every unit and integration test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
scripts/install-kube.sh >/dev/null
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
