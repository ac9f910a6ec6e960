#!/usr/bin/env bash
# After the suite: fails if any test left a real node, a network namespace, a process,
# a mount (what testkit::node and testkit::netns create) or a CCM's secrets directory
# in the temp dir behind. With a file as $1, only secrets directories newer than it
# count (scripts/test.sh passes the one it made at its start).
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
since=()
[ -n "${1:-}" ] && since=(-newer "$1")
while read -r d; do
  [ -n "$d" ] && left+=("CCM secrets directory $d (tokens or keys left on disk)")
done < <(find "${TMPDIR:-/tmp}" -maxdepth 1 -name 'tether-ccm-*' "${since[@]}" 2>/dev/null || true)
if [ ${#left[@]} -gt 0 ]; then
  printf 'left behind by the tests:\n' >&2
  printf '  %s\n' "${left[@]}" >&2
  exit 1
fi
echo "nothing left behind: no node cgroup, network namespace, process, mount or CCM secrets directory"
