# Sourced by the install scripts that build a pinned Go program into the version-keyed cache outside the
# repository (install-kubernetes.sh, install-helm.sh, install-coredns.sh; install-crds.sh fetches files): what
# they do the same way. Sourced as `. scripts/gobuild.sh NAME`: log() lines say "[install-NAME]"; CACHE is the
# cache (CB_CACHE moves it).
# Then:
#   print_only FLAG PATH "$@"  with FLAG (--print-dir, --print-path) as the script's first argument, print PATH
#                       and exit without building
#   cached FILE [PATH]  FILE is built: print PATH (default FILE) and exit (nothing is rebuilt)
#   need_go WHAT        no Go toolchain: say so and fail; else the build's settings, and the clock starts
#   built WHAT PATH     the closing log line with the time taken, then PATH on stdout's last line (what the
#                       callers read)
# and watch_build (progress.sh): a background build that says every 30 s what it is compiling.
CACHE=${CB_CACHE:-$HOME/.cache/containerboot-py}
. "$(dirname "${BASH_SOURCE[0]}")/progress.sh"

_gobuild_name=${1:-build}
log() { echo "[install-$_gobuild_name] $*" >&2; }

print_only() {
  if [ "${3:-}" = "$1" ]; then echo "$2"; exit 0; fi
}

cached() {
  if [ -x "$1" ]; then echo "${2:-$1}"; exit 0; fi
}

need_go() {
  command -v go >/dev/null 2>&1 || { log "no Go toolchain: cannot build $1"; exit 1; }
  export GOTOOLCHAIN=local CGO_ENABLED=0
  _gobuild_start=$(date +%s)
}

built() {
  log "$1 built in $(( $(date +%s) - ${_gobuild_start:-$(date +%s)} ))s into $2"
  echo "$2"
}
