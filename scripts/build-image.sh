#!/usr/bin/env bash
# Builds the Tether image from deploy/Dockerfile (the file users build) with Debian's
# buildah, pulling nothing:
#   - BASE is tether.local/debian-cc:12, made here from this Debian machine's own glibc,
#     libgcc, CA bundle and netbase files with a `nonroot` user 65532: what distroless/cc
#     holds, cached in buildah's storage until this script or the glibc changes;
#   - BINARIES=prebuilt: the binaries already built (stripped of debug info) stand in for
#     the builder stage, which needs rust:1-bookworm from a registry.
# Writes an OCI archive whose reference is the image the manifests name (normalised as a
# kubelet resolves it: tether:v0.1.0 -> docker.io/library/tether:v0.1.0), prints its path
# and the image's size.
#
# Usage: scripts/build-image.sh [--binaries DIR] [--tag TAG] [--out FILE]
#   --binaries DIR  where tether and tether-agent are (default: target/release, built
#                   with `cargo build --release` first when DIR is not given)
#   --tag TAG       the image reference (default: the one deploy/konnectivity-agent.yaml
#                   names)
#   --out FILE      the archive (default: $TETHER_CACHE/images/<name>-<tag>.oci.tar)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${TETHER_CACHE:-$HOME/.cache/tether}"
binaries=""
tag=""
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --binaries) binaries="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "build-image.sh: unknown argument $1 (see the usage at the top of the script)" >&2; exit 2 ;;
  esac
done
[ -n "$tag" ] || tag="$(awk '/^ *image: /{print $2; exit}' "$ROOT/deploy/konnectivity-agent.yaml")"
if [ -z "$binaries" ]; then
  (cd "$ROOT" && cargo build --release --locked --bin tether --bin tether-agent >&2)
  binaries="$ROOT/target/release"
fi
for b in tether tether-agent; do
  [ -x "$binaries/$b" ] || { echo "build-image.sh: $binaries/$b is missing: build it first" >&2; exit 1; }
done

# Root: buildah's rootful storage, and the base's files owned by 0 and 65532.
[ "$(id -u)" -eq 0 ] || { echo "build-image.sh: run it as root" >&2; exit 1; }
if ! command -v buildah >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah >&2
fi

# A reference as a kubelet resolves it: a bare name is docker.io/library/NAME.
name="$tag"
version=latest
last="${tag##*:}"
if [ "$last" != "$tag" ] && [[ "$last" != */* ]]; then
  name="${tag%:*}"
  version="$last"
fi
case "$name" in
  */*) first="${name%%/*}" ;;
  *) first="" ;;
esac
if [ -z "$first" ]; then
  full="docker.io/library/$name:$version"
elif [[ "$first" == *.* || "$first" == *:* || "$first" == localhost ]]; then
  full="$name:$version"
else
  full="docker.io/$name:$version"
fi
[ -n "$out" ] || out="$CACHE/images/$(echo "$name" | tr '/:' '__')-$version.oci.tar"
mkdir -p "$(dirname "$out")"

work="$(mktemp -d)"
cleanup() {
  [ -z "${base_ctr:-}" ] || buildah rm "$base_ctr" >/dev/null 2>&1 || true
  rm -rf "$work" "$out.tmp"
}
trap cleanup EXIT
# One build at a time on this machine: builds share buildah's storage and tags.
mkdir -p "$CACHE"
exec 9>"$CACHE/build-image.lock"
flock 9
dangling() { buildah images --quiet --filter dangling=true 2>/dev/null | sort; }
dangling_before="$(dangling)"

# The base: distroless/cc's contents, from this machine's Debian packages.
arch_lib=/usr/lib/x86_64-linux-gnu
stamp="$( (cat "$0"; sha256sum "$arch_lib/libc.so.6" "$arch_lib/libgcc_s.so.1") | sha256sum | cut -c1-12)"
base="tether.local/debian-cc:12-$stamp"
if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
  r="$work/rootfs"
  mkdir -p "$r$arch_lib" "$r/usr/lib64" "$r/etc/ssl/certs" "$r/tmp" "$r/home/nonroot" "$r/root" "$r/var/run"
  ln -s usr/lib "$r/lib"
  ln -s usr/lib64 "$r/lib64"
  for lib in ld-linux-x86-64.so.2 libc.so.6 libm.so.6 libgcc_s.so.1 libdl.so.2 libpthread.so.0 \
    librt.so.1 libresolv.so.2 libnss_files.so.2 libnss_dns.so.2; do
    cp -L "$arch_lib/$lib" "$r$arch_lib/$lib"
  done
  ln -s ../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 "$r/usr/lib64/ld-linux-x86-64.so.2"
  # Debian's bundle (ca-certificates), as this machine has it: local additions included.
  [ -f /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$r/etc/ssl/certs/"
  for f in services protocols; do [ -f "/etc/$f" ] && cp "/etc/$f" "$r/etc/$f"; done
  cp /etc/os-release "$r/etc/os-release"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$r/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\nnonroot:x:65532:\n' >"$r/etc/group"
  printf 'hosts: files dns\nnetworks: files\n' >"$r/etc/nsswitch.conf"
  chmod 1777 "$r/tmp"
  chmod 0700 "$r/root" "$r/home/nonroot"
  chown -R 0:0 "$r"
  chown 65532:65532 "$r/home/nonroot"
  tar -C "$r" --numeric-owner --mtime=@0 --sort=name -cf "$work/rootfs.tar" .
  base_ctr="$(buildah from scratch)"
  buildah add --quiet "$base_ctr" "$work/rootfs.tar" / >/dev/null
  buildah config --env PATH=/usr/local/bin:/usr/bin:/bin --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    --user 65532:65532 --workingdir /home/nonroot \
    --label "org.opencontainers.image.description=glibc, CA certificates, user 65532 (from Debian packages)" "$base_ctr"
  buildah commit --quiet --rm "$base_ctr" "$base" >/dev/null
  base_ctr=""
fi

# The build context: the Dockerfile's prebuilt stage takes target/release/{tether,tether-agent},
# the final stage deploy/image-links (upstream's program names).
ctx="$work/context"
mkdir -p "$ctx/target/release" "$ctx/deploy"
cp -a "$ROOT/deploy/image-links" "$ctx/deploy/"
for b in tether tether-agent; do
  objcopy --strip-debug "$binaries/$b" "$ctx/target/release/$b"
done
buildah build --quiet --layers=false --pull=never \
  --build-arg "BASE=$base" --build-arg BINARIES=prebuilt \
  -f "$ROOT/deploy/Dockerfile" -t "$full" "$ctx" >/dev/null
rm -f "$out.tmp"
buildah push --quiet "$full" "oci-archive:$out.tmp:$full" >/dev/null
mv "$out.tmp" "$out"
# The intermediate stages' unnamed images (only those this build made).
for id in $(comm -13 <(echo "$dangling_before") <(dangling)); do
  buildah rmi "$id" >/dev/null 2>&1 || true
done
size="$(buildah inspect --type image --format '{{.Docker.Size}}' "$full" 2>/dev/null || true)"
[ -n "$size" ] && [ "$size" != 0 ] || size="$(buildah images --format '{{.Size}}' "$full" | head -1)"
echo "image $full ($size uncompressed; archive $(du -h "$out" | cut -f1))" >&2
echo "$out"
