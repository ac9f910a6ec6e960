#!/usr/bin/env bash
# Writes the two container images the real-node tests run, as docker-archive tarballs that
# `ctr images import` takes (images cannot be pulled on this machine):
#   - tether.local/pause:1    the pod sandbox: a static C binary that waits for signals;
#   - tether.local/busybox:1  Debian's busybox-static with a link per applet (sh, cat, tar,
#                             httpd, sha256sum, ...), enough for exec, attach, cp and an httpd.
# Cached as $TETHER_CACHE/images/{pause,busybox}.tar; rebuilt only when the busybox binary
# or this script changes. Prints the image directory.
set -euo pipefail

CACHE="${TETHER_CACHE:-$HOME/.cache/tether}"
OUT="$CACHE/images"
mkdir -p "$OUT"
stamp="$( (sha256sum "$0" /bin/busybox) | sha256sum | cut -c1-16)"
if [ -f "$OUT/pause.tar" ] && [ -f "$OUT/busybox.tar" ] && [ "$(cat "$OUT/stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "$OUT"
  exit 0
fi

if ldd /bin/busybox >/dev/null 2>&1; then
  echo "/bin/busybox is dynamically linked: install busybox-static (scripts/install-kube.sh does)" >&2
  exit 1
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# pause: PID 1 of every pod sandbox. Reaps children, exits on SIGINT/SIGTERM.
cat >"$work/pause.c" <<'EOF'
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }
int main(void) {
  struct sigaction q = {0}, r = {0};
  q.sa_handler = quit;
  r.sa_handler = reap;
  r.sa_flags = SA_NOCLDSTOP;
  sigaction(SIGINT, &q, NULL);
  sigaction(SIGTERM, &q, NULL);
  sigaction(SIGCHLD, &r, NULL);
  for (;;) pause();
}
EOF
mkdir -p "$work/pause-root"
gcc -static -Os -o "$work/pause-root/pause" "$work/pause.c"
strip "$work/pause-root/pause"

mkdir -p "$work/busybox-root/bin" "$work/busybox-root/etc" "$work/busybox-root/tmp" "$work/busybox-root/www"
chmod 1777 "$work/busybox-root/tmp"
cp /bin/busybox "$work/busybox-root/bin/busybox"
for applet in $(/bin/busybox --list); do
  [ "$applet" = busybox ] || ln -sf busybox "$work/busybox-root/bin/$applet"
done
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$work/busybox-root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$work/busybox-root/etc/group"
echo 'hello from the pod' >"$work/busybox-root/www/index.html"

# One-layer docker-archive: manifest.json, the image config, the layer tarball.
python3 - "$work" "$OUT" <<'EOF'
import hashlib, io, json, os, sys, tarfile

work, out = sys.argv[1], sys.argv[2]

def layer(root):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(os.listdir(root)):
            tar.add(os.path.join(root, name), arcname=name, filter=normalise)
    return buf.getvalue()

def normalise(info):
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info

def image(name, root, tag, config):
    data = layer(root)
    diff = "sha256:" + hashlib.sha256(data).hexdigest()
    cfg = json.dumps({
        "architecture": "amd64", "os": "linux", "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff]}, "history": [{"created_by": "tether scripts/node-images.sh"}],
    }, sort_keys=True).encode()
    cfg_name = hashlib.sha256(cfg).hexdigest() + ".json"
    manifest = json.dumps([{"Config": cfg_name, "RepoTags": [tag], "Layers": ["layer.tar"]}]).encode()
    path = os.path.join(out, name + ".tar")
    with tarfile.open(path + ".tmp", mode="w") as tar:
        for member, content in (("layer.tar", data), (cfg_name, cfg), ("manifest.json", manifest)):
            info = tarfile.TarInfo(member)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    os.replace(path + ".tmp", path)

image("pause", os.path.join(work, "pause-root"), "tether.local/pause:1", {"Entrypoint": ["/pause"]})
image("busybox", os.path.join(work, "busybox-root"), "tether.local/busybox:1",
      {"Cmd": ["sh"], "Env": ["PATH=/bin"], "WorkingDir": "/"})
EOF
echo "$stamp" >"$OUT/stamp"
echo "$OUT"
