#!/usr/bin/env bash
# Installs what the real-cluster tests need, idempotently, with caches outside the repo:
#   - etcd from Debian's etcd-server package;
#   - kube-apiserver, kubelet, kube-controller-manager, kube-scheduler and kube-proxy 1.20.2 built from Debian
#     bookworm's `kubernetes` source package (full vendor/ tree) with golang-1.19-go,
#     cached as $TETHER_CACHE/<name>-1.20.2;
#   - the node runtime: containerd, runc, the CNI plugins, busybox-static, iptables, and the
#     two local images (pause, busybox) written by scripts/node-images.sh;
#   - buildah, which builds our image from deploy/Dockerfile (scripts/build-image.sh);
#   - tether-grpc-go-peer, our grpc-go test double for the upstream agent and server
#     (testkit/grpc-go-peer/main.go), built against the same tree's vendored grpc-go and
#     cached as $TETHER_CACHE/tether-grpc-go-peer with the source's sha256 beside it.
# A second run does nothing. Prints the apiserver binary path on its last line.
set -euo pipefail

CACHE="${TETHER_CACHE:-$HOME/.cache/tether}"
VERSION=1.20.2
BIN="$CACHE/kube-apiserver-$VERSION"
mkdir -p "$CACHE"

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
apt_updated=""
apt_install() {
  if [ -z "$apt_updated" ]; then $SUDO apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@"
}

command -v etcd >/dev/null 2>&1 || apt_install etcd-server
command -v kubectl >/dev/null 2>&1 || apt_install kubernetes-client
# The real node: container runtime, CNI, the busybox the images are made of, and the
# tools the node harness uses (nsenter, setpriv from util-linux; iptables; gcc for pause).
command -v containerd >/dev/null 2>&1 || apt_install containerd
command -v runc >/dev/null 2>&1 || apt_install runc
[ -x /usr/lib/cni/bridge ] || [ -x /opt/cni/bin/bridge ] || apt_install containernetworking-plugins
# The images need a static busybox (Debian's `busybox` package is dynamic).
if ! { [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1; }; then apt_install busybox-static; fi
command -v iptables >/dev/null 2>&1 || apt_install iptables
command -v socat >/dev/null 2>&1 || apt_install socat
command -v script >/dev/null 2>&1 || apt_install bsdutils
command -v gcc >/dev/null 2>&1 || apt_install gcc libc6-dev
# Our image, built from deploy/Dockerfile with no registry pull (scripts/build-image.sh).
command -v buildah >/dev/null 2>&1 || apt_install buildah
command -v objcopy >/dev/null 2>&1 || apt_install binutils
"$(dirname "$0")/node-images.sh" >/dev/null

KUBE_BINS=(kube-apiserver kubelet kube-controller-manager kube-scheduler kube-proxy)
missing=()
for b in "${KUBE_BINS[@]}"; do [ -x "$CACHE/$b-$VERSION" ] || missing+=("$b"); done
PEER_SRC="$(cd "$(dirname "$0")/.." && pwd)/testkit/grpc-go-peer/main.go"
PEER="$CACHE/tether-grpc-go-peer"
peer_sum=$(sha256sum "$PEER_SRC" | cut -d' ' -f1)
peer_stale=""
{ [ -x "$PEER" ] && [ "$(cat "$PEER.sha256" 2>/dev/null)" = "$peer_sum" ]; } || peer_stale=1
if [ ${#missing[@]} -eq 0 ] && [ -z "$peer_stale" ]; then
  echo "$BIN"
  exit 0
fi

# Source packages: add deb-src for the bookworm main archive already configured for
# binary packages (same mirror, no new host).
if ! apt-get source --print-uris kubernetes >/dev/null 2>&1; then
  src=/etc/apt/sources.list.d/tether-deb-src.sources
  uri=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    uri=$(awk '/^URIs:/{u=$2} /^Suites:/ && /(^| )bookworm( |$)/{print u; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri=$(awk '$1=="deb" && $3=="bookworm" {print $2; exit}' /etc/apt/sources.list)
  fi
  [ -n "$uri" ] || { echo "no bookworm apt source found to derive a deb-src line from" >&2; exit 1; }
  printf 'Types: deb-src\nURIs: %s\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' "$uri" | $SUDO tee "$src" >/dev/null
  apt_updated=""
fi
[ -n "$apt_updated" ] || { $SUDO apt-get update -qq; apt_updated=1; }
command -v rsync >/dev/null 2>&1 || apt_install rsync
[ -x /usr/lib/go-1.19/bin/go ] || apt_install golang-1.19-go
command -v dpkg-source >/dev/null 2>&1 || apt_install dpkg-dev

work="$CACHE/kubernetes-src"
if [ ! -f "$work/.unpacked" ]; then
  rm -rf "$work"
  mkdir -p "$work"
  (cd "$work" && apt-get source -qq kubernetes >/dev/null)
  touch "$work/.unpacked"
fi
tree=$(find "$work" -maxdepth 1 -mindepth 1 -type d -name 'kubernetes-*' | head -n 1)
[ -n "$tree" ] || { echo "kubernetes source tree not found in $work" >&2; exit 1; }

# Build the way debian/rules does: GOPATH with k8s.io/kubernetes pointing at the tree.
(
  cd "$tree"
  mkdir -p .go/src/k8s.io
  ln -sfn "$tree" .go/src/k8s.io/kubernetes
  export GOPATH="$tree/.go" GO111MODULE=off CGO_ENABLED=0 GOCACHE="$CACHE/go-build" GOFLAGS=-mod=vendor
  export PATH="/usr/lib/go-1.19/bin:$PATH"
  export KUBE_GIT_VERSION="v$VERSION" KUBE_GIT_TREE_STATE=clean
  cd .go/src/k8s.io/kubernetes
  if [ ${#missing[@]} -gt 0 ]; then
    what=""
    for b in "${missing[@]}"; do what="$what cmd/$b"; done
    make WHAT="${what# }" >&2
    for b in "${missing[@]}"; do
      cp _output/local/bin/linux/*/"$b" "$CACHE/$b-$VERSION.tmp" 2>/dev/null || cp _output/bin/"$b" "$CACHE/$b-$VERSION.tmp"
    done
  fi
  if [ -n "$peer_stale" ]; then
    # A package inside the tree, so GOPATH mode resolves its imports from vendor/.
    mkdir -p cmd/tether-grpc-go-peer
    cp "$PEER_SRC" cmd/tether-grpc-go-peer/main.go
    GOFLAGS= go build -o "$PEER.tmp" ./cmd/tether-grpc-go-peer
  fi
)
for b in "${missing[@]}"; do mv "$CACHE/$b-$VERSION.tmp" "$CACHE/$b-$VERSION"; done
if [ -n "$peer_stale" ]; then
  mv "$PEER.tmp" "$PEER"
  echo "$peer_sum" > "$PEER.sha256"
fi
echo "$BIN"
