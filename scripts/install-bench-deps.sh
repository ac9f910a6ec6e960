#!/usr/bin/env bash
# Installs what the benchmark compares against (OpenSSH server and client for ssh -L),
# idempotently.
set -euo pipefail
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if ! [ -x /usr/sbin/sshd ] || ! command -v ssh >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends openssh-server openssh-client
  # The package starts a system sshd; the benchmark runs its own on a private port.
  $SUDO systemctl disable --now ssh >/dev/null 2>&1 || $SUDO service ssh stop >/dev/null 2>&1 || true
fi
