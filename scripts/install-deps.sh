#!/usr/bin/env bash
# Installs the system tools Tether's tests use (curl, openssl, iproute2, util-linux's
# prlimit, python3 for the stand-in kubelet, tinyproxy for the egress-proxy tests, nginx
# (the reverse proxy WebSocket agents go through),
# prometheus and promtool for the monitoring rules' tests), idempotently: nothing is
# downloaded when they are already present. Debian/Ubuntu (apt) only.
set -euo pipefail

need=()
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v kill >/dev/null 2>&1 || need+=(procps)
command -v prlimit >/dev/null 2>&1 || need+=(util-linux)
command -v python3 >/dev/null 2>&1 || need+=(python3)
command -v tinyproxy >/dev/null 2>&1 || need+=(tinyproxy)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
{ command -v promtool && command -v prometheus; } >/dev/null 2>&1 || need+=(prometheus)

if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo is missing: install a Rust toolchain (rustup) first" >&2
  exit 1
fi
