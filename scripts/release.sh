#!/usr/bin/env bash
# A release: both images for linux/amd64 and linux/arm64 pushed as multi-arch indexes, and the chart, version =
# appVersion = the release's version, pushed as an OCI artifact, its image references pinned by tag and digest.
# `make release VERSION=x.y.z REGISTRY=...` runs it.
#
#   bash scripts/release.sh --registry registry.example.com/tailscale [--version 0.1.0]
#        [--platforms linux/amd64,linux/arm64] [--cert-dir DIR] [--authfile FILE] [--out DIR]
#
# The version is the file VERSION (the one place it is written); --version, when given, must equal it (a
# release of another version is a bump of VERSION and a CHANGELOG.md entry first). Chart.yaml's version and
# appVersion must equal it too (tests/test_helm_chart.py keeps them in step).
#
# How the images get to the registry: images/release.sh --offline builds one OCI archive per image and platform
# (the offline build of this repository: its Debian bases made with mmdebstrap, tailscaled built with Go, foreign
# platforms' RUN steps under qemu user mode), then podman assembles each image's archives into a manifest list
# (`podman manifest add LIST oci-archive:...`) and pushes it with all its images (`podman manifest push --all`):
# the registry holds an index per image, each platform's manifest under it, and the index's digest is what the
# chart pins. The same archives are what `make images-archives` checks, so what is pushed is what was tested.
#
# The chart: a copy of charts/tailscale-controller with Chart.yaml's version/appVersion set to the release's,
# values.yaml's imageRegistry set to --registry and image.digest / proxy.image.digest set to the pushed indexes'
# digests; `helm package`, then `helm push ... oci://<registry>/charts`. Checked before pushing: `helm template`
# of the packaged chart names exactly the pushed references.
#
# Credentials: --authfile (containers-auth.json / docker config.json format: podman's and helm's) and
# --cert-dir (a directory with ca.crt, for a registry whose CA is private); without them podman and helm use
# their own login (`podman login`, `helm registry login`) and the system's CAs.
#
# TAILSCALE_VERSION (environment, e.g. 1.102.3) is the tailscale in the proxy image: a Tailscale security
# release is a rebuild with it changed (images/tailscale.sh builds that tailscaled), nothing else.
#
# Writes <out>/release-<version>.json: the references pushed and their digests (each platform's too).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
log() { echo "[release] $*" >&2; }

REGISTRY= VERSION_ARG= PLATFORMS=linux/amd64,linux/arm64 CERT_DIR= AUTHFILE= OUT=${RELEASE_OUT:-$repo/dist}
while [ $# -gt 0 ]; do
  case "$1" in
    --registry) REGISTRY=${2%/}; shift 2 ;;
    --version) VERSION_ARG=$2; shift 2 ;;
    --platforms) PLATFORMS=$2; shift 2 ;;
    --cert-dir) CERT_DIR=$2; shift 2 ;;
    --authfile) AUTHFILE=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) log "unknown argument $1 (see the header of $0)"; exit 2 ;;
  esac
done
[ -n "$REGISTRY" ] || { log "--registry is required (make release REGISTRY=registry.example.com/tailscale)"; exit 2; }
VERSION=$(tr -d '[:space:]' < "$repo/VERSION")
[[ $VERSION =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] || { log "VERSION holds '$VERSION', not a version x.y.z"; exit 2; }
if [ -n "$VERSION_ARG" ] && [ "$VERSION_ARG" != "$VERSION" ]; then
  log "VERSION=$VERSION_ARG but the file VERSION says $VERSION: to release $VERSION_ARG, write it to VERSION, to Chart.yaml's version and appVersion, and add a '## $VERSION_ARG' entry to CHANGELOG.md first"
  exit 2
fi
chart_src=$repo/charts/tailscale-controller
for f in version appVersion; do
  v=$(sed -n "s/^$f: *\"\{0,1\}\([^\"]*\)\"\{0,1\}\$/\1/p" "$chart_src/Chart.yaml")
  [ "$v" = "$VERSION" ] || { log "charts/tailscale-controller/Chart.yaml has $f: $v but VERSION is $VERSION: set it to $VERSION"; exit 2; }
done
grep -q "^## $VERSION\b" "$repo/CHANGELOG.md" || { log "CHANGELOG.md has no '## $VERSION' entry: say what this release changes first"; exit 2; }
command -v podman >/dev/null || { log "podman is missing: run scripts/setup.sh --image"; exit 1; }
helm=$(bash "$repo/scripts/install-helm.sh")/helm

tls=() auth=() hauth=()
if [ -n "$CERT_DIR" ]; then
  [ -s "$CERT_DIR/ca.crt" ] || { log "--cert-dir $CERT_DIR has no ca.crt"; exit 2; }
  tls=(--cert-dir "$CERT_DIR")
fi
if [ -n "$AUTHFILE" ]; then
  [ -s "$AUTHFILE" ] || { log "--authfile $AUTHFILE is missing or empty"; exit 2; }
  auth=(--authfile "$AUTHFILE")
  hauth=(--registry-config "$AUTHFILE")
fi
hca=()
[ -z "$CERT_DIR" ] || hca=(--ca-file "$CERT_DIR/ca.crt")

start=$(date +%s)
# 1. one archive per image and platform (cached by image ID: unchanged sources are not rebuilt)
bash "$repo/images/release.sh" --registry "$REGISTRY" --tag "$VERSION" --platforms "$PLATFORMS" --offline
arch_dir=$(bash "$repo/images/release.sh" --registry "$REGISTRY" --tag "$VERSION" --print-out)
built=$(date +%s)

# 2. a manifest list per image from its archives, pushed with all its images
mkdir -p "$OUT"
work=$(mktemp -d "${TMPDIR:-/tmp}/cbpy-release.XXXXXX")
lists=()
cleanup() {
  local l
  for l in "${lists[@]}"; do podman manifest rm "$l" >/dev/null 2>&1 || true; done
  rm -rf "$work"
}
trap cleanup EXIT
IFS=, read -r -a platforms <<< "$PLATFORMS"
declare -A DIGEST
for n in containerboot-py containerboot-py-controller; do
  ref="$REGISTRY/$n:$VERSION"
  list="localhost/cbpy-release-list/$n:$VERSION-$$"
  podman manifest rm "$list" >/dev/null 2>&1 || true
  podman manifest create "$list" >/dev/null
  lists+=("$list")
  for p in "${platforms[@]}"; do
    podman manifest add "$list" "oci-archive:$arch_dir/$n-$VERSION-linux-${p#linux/}.oci.tar" >/dev/null
  done
  log "pushing $ref (${PLATFORMS})"
  podman manifest push --all --format oci --digestfile "$work/$n.digest" "${tls[@]}" "${auth[@]}" \
    "$list" "docker://$ref" >&2
  DIGEST[$n]=$(cat "$work/$n.digest")
  [[ ${DIGEST[$n]} =~ ^sha256:[a-f0-9]{64}$ ]] || { log "podman reported no digest for $ref"; exit 1; }
  log "$ref@${DIGEST[$n]}"
done
pushed=$(date +%s)

# 3. the chart, pinned to what was pushed
cp -r "$chart_src" "$work/chart"
python3 - "$work/chart" "$VERSION" "$REGISTRY" "${DIGEST[containerboot-py-controller]}" "${DIGEST[containerboot-py]}" <<'PY'
import re, sys
from pathlib import Path
chart, version, registry, ctl, proxy = Path(sys.argv[1]), *sys.argv[2:]
def sub(path: Path, pattern: str, repl: str) -> None:
    text, n = re.subn(pattern, repl, path.read_text(), count=1, flags=re.M)
    if n != 1:
        sys.exit(f"[release] {path.name}: no line matches {pattern!r}; the chart's layout changed, update scripts/release.sh")
    path.write_text(text)
meta, values = chart / "Chart.yaml", chart / "values.yaml"
sub(meta, r'^version: .*$', f"version: {version}")
sub(meta, r'^appVersion: .*$', f'appVersion: "{version}"')
sub(values, r'^imageRegistry: .*$', f'imageRegistry: "{registry}"')
# image.digest is the first `  digest:` (two spaces: the controller's image), proxy.image.digest the `    digest:`
sub(values, r'^  digest: .*$', f'  digest: "{ctl}"')
sub(values, r'^    digest: .*$', f'    digest: "{proxy}"')
PY
"$helm" package "$work/chart" --destination "$OUT" >&2
tgz=$OUT/tailscale-controller-$VERSION.tgz
rendered=$("$helm" template check "$tgz" --set headscale.url=https://headscale.invalid)
for want in "$REGISTRY/containerboot-py-controller:$VERSION@${DIGEST[containerboot-py-controller]}" \
            "$REGISTRY/containerboot-py:$VERSION@${DIGEST[containerboot-py]}"; do
  grep -qF "\"$want\"" <<<"$rendered" || { log "the packaged chart does not name $want"; exit 1; }
done
log "pushing the chart to oci://$REGISTRY/charts"
"$helm" push "$tgz" "oci://$REGISTRY/charts" "${hca[@]}" "${hauth[@]}" 2>"$work/helm-push.log" >&2 \
  || { cat "$work/helm-push.log" >&2; exit 1; }
cat "$work/helm-push.log" >&2
chart_digest=$(sed -n 's/^Digest: *//p' "$work/helm-push.log")

# 4. the record of the release
python3 - "$OUT/release-$VERSION.json" "$VERSION" "$REGISTRY" "$chart_digest" "$((built - start))" \
  "$((pushed - built))" "${DIGEST[containerboot-py]}" "${DIGEST[containerboot-py-controller]}" <<'PY'
import json, sys
out, version, registry, chart_digest, build_s, push_s, proxy, ctl = sys.argv[1:]
json.dump({"version": version, "registry": registry,
           "images": {"containerboot-py": f"{registry}/containerboot-py:{version}@{proxy}",
                      "containerboot-py-controller": f"{registry}/containerboot-py-controller:{version}@{ctl}"},
           "chart": {"ref": f"oci://{registry}/charts/tailscale-controller", "version": version,
                     "digest": chart_digest},
           "seconds": {"build": int(build_s), "push": int(push_s)}}, open(out, "w"), indent=1)
PY
log "released $VERSION to $REGISTRY in $(( $(date +%s) - start ))s: $OUT/release-$VERSION.json"
echo "$OUT/release-$VERSION.json"
