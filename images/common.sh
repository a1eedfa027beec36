# Shared by the image scripts (sourced, not run). Host facts are detected here, never assumed, so the same
# scripts work on a machine where podman's defaults are fine.
CB_CACHE=${CB_CACHE:-$HOME/.cache/containerboot-py}
IMAGES_CACHE="$CB_CACHE/images"
log() { echo "[image] $*" >&2; }

# The OCI runtime for podman. crun refuses a "hybrid" cgroup layout (cgroup v1 mounted at /sys/fs/cgroup plus a
# cgroup2 mount that holds controllers): every container, build steps included, fails with "cgroups in hybrid
# mode not supported". runc handles it. CB_OCI_RUNTIME overrides the choice.
oci_runtime() {
  if [ -n "${CB_OCI_RUNTIME:-}" ]; then echo "$CB_OCI_RUNTIME"; return; fi
  local def
  def=$(podman info --format '{{.Host.OCIRuntime.Name}}' 2>/dev/null || echo "")
  if [ "$def" = crun ] && [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" != cgroup2fs ] \
     && [ -s /sys/fs/cgroup/unified/cgroup.controllers ] && command -v runc >/dev/null 2>&1; then
    echo runc
  else
    echo "${def:-runc}"
  fi
}

# podman with the runtime above: `pod build ...`, `pod run ...`.
pod() { podman --runtime "$(oci_runtime)" "$@"; }

# `podman run` rlimit flags: podman asks for nofile=1048576 by default, which fails with "setrlimit
# RLIMIT_NOFILE: Operation not permitted" when the caller's hard limit is lower and it lacks CAP_SYS_RESOURCE.
# The caller's own hard limits can always be set, so pass those, except that podman (4.3, measured in its
# /proc/<pid>/limits) lowers its own RLIMIT_NPROC to 32768 when it cannot raise it, so nproc is capped there.
run_ulimits() {
  local n u
  n=$(ulimit -Hn); u=$(ulimit -Hu)
  [ "$n" = unlimited ] && n=1048576
  if [ "$u" = unlimited ] || [ "$u" -gt 32768 ]; then u=32768; fi
  echo "--ulimit nofile=$n:$n --ulimit nproc=$u:$u"
}

# Where an image's OCI archive goes: the cache, outside the repository, named after the image.
archive_path() {  # image name (localhost/containerboot-py:latest)
  local n=${1#localhost/}
  echo "$IMAGES_CACHE/${n//[:\/]/_}.oci.tar"
}

# Debian's (and OCI's) architecture name -> qemu's, for binfmt_misc entries.
qemu_arch() {
  case "$1" in
    amd64) echo x86_64 ;; arm64) echo aarch64 ;; armhf|armel) echo arm ;; ppc64el) echo ppc64le ;; *) echo "$1" ;;
  esac
}

# Programs of a foreign architecture (a base's maintainer scripts, a Dockerfile's RUN steps) run under qemu
# user mode through the kernel's binfmt_misc. Makes sure the architecture's entry is registered, with the F
# flag (the interpreter is opened at registration, so it also works inside containers and chroots): done here
# when qemu-user-static is installed and we are root, else a failure that names the fix.
foreign_ready() {  # Debian architecture
  local q bm=/proc/sys/fs/binfmt_misc conf
  q=$(qemu_arch "$1")
  if [ ! -e "$bm/register" ]; then
    [ "$(id -u)" = 0 ] && mount -t binfmt_misc binfmt_misc "$bm" 2>/dev/null || true
  fi
  if [ -e "$bm/qemu-$q" ]; then
    grep -q '^enabled' "$bm/qemu-$q" && grep -q '^flags:.*F' "$bm/qemu-$q" && return 0
    log "binfmt_misc has qemu-$q but it is disabled or lacks the F flag: echo -1 > $bm/qemu-$q, then run this again"
    exit 1
  fi
  conf=/usr/lib/binfmt.d/qemu-$q.conf
  if [ ! -s "$conf" ]; then
    log "building for $1 needs qemu user mode: apt-get install qemu-user-static (or run scripts/setup.sh --multiarch)"
    exit 1
  fi
  if [ "$(id -u)" != 0 ] || ! cat "$conf" > "$bm/register" 2>/dev/null; then
    log "cannot register qemu-$q with binfmt_misc ($bm/register): as root, cat $conf > $bm/register"
    exit 1
  fi
  log "registered qemu-$q with binfmt_misc for $1 programs"
}
