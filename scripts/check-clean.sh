#!/usr/bin/env bash
# After the suite: fails if any test left a real node, a network namespace, a process
# or a mount behind (what testkit::node and testkit::netns create).
set -euo pipefail
left=()
for h in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do
  for cg in "$h"tether-node-*; do [ -e "$cg" ] && left+=("cgroup $cg"); done
done
while read -r ns _; do
  case "$ns" in tt[0-9]*n[0-9]*) left+=("network namespace $ns");; esac
done < <(ip netns list 2>/dev/null || true)
for p in /proc/[0-9]*; do
  cmd=$(tr '\0' ' ' <"$p/cmdline" 2>/dev/null || true)
  case "$cmd" in
    *tether-node-*|*tether-cluster-*|*tether-pki-*) left+=("process ${p#/proc/}: $cmd");;
  esac
done
grep -q 'tether-node-' /proc/self/mountinfo && left+=("mounts of tether-node-* directories")
if [ ${#left[@]} -gt 0 ]; then
  printf 'left behind by the tests:\n' >&2
  printf '  %s\n' "${left[@]}" >&2
  exit 1
fi
echo "nothing left behind: no node cgroup, network namespace, process or mount"
