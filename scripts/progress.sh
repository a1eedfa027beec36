# Sourced by the install scripts: `watch_build PID WHAT` waits for a build running in the background and, every
# 30 s, says what it is doing (the Go packages being compiled or the binary being linked, read from the
# build's own child processes), so a cold build of several minutes shows it is not stuck. Returns the
# build's exit status.
_build_children() {
  local c
  for c in $(pgrep -P "$1" 2>/dev/null); do echo "$c"; _build_children "$c"; done
}

_build_activity() {
  local p comm args pkgs=() linking=""
  for p in $(_build_children "$1"); do
    comm=$(cat "/proc/$p/comm" 2>/dev/null) || continue
    args=$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null) || continue
    case "$comm" in
      compile) [[ $args =~ \ -p\ ([^ ]+) ]] && pkgs+=("${BASH_REMATCH[1]}") ;;
      link) [[ $args =~ \ -o\ ([^ ]+) ]] && linking="linking ${BASH_REMATCH[1]##*/}" ;;
    esac
  done
  if [ -n "$linking" ]; then echo "$linking"
  elif [ ${#pkgs[@]} -gt 0 ]; then echo "compiling ${pkgs[*]}"
  else echo "resolving and downloading modules"
  fi
}

watch_build() {
  local pid=$1 what=$2 t0=$SECONDS n=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    n=$((n + 1))
    if [ $((n % 30)) -eq 0 ] && kill -0 "$pid" 2>/dev/null; then
      echo "[build] $what: $(( (SECONDS - t0) / 60 ))m$(( (SECONDS - t0) % 60 ))s, $(_build_activity "$pid")" >&2
    fi
  done
  wait "$pid"
}
