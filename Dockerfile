# The proxy image: the Python containerboot agent with tailscaled and tailscale, at the same paths as
# upstream's tailscale/tailscale image (/usr/local/bin/containerboot, tailscaled, tailscale), so manifests
# written for upstream's image work unchanged.
#
#   docker build -t containerboot-py .                      # anywhere with a registry
#   make image                                              # here, offline (images/build.sh)
#
# BASE is any Debian bookworm (or later) image with Python 3.11+; the default is the official slim one. The
# offline build passes a base made with mmdebstrap from the machine's apt sources (images/base.sh).
# TAILSCALE_IMAGE is any image with tailscaled and tailscale in /usr/local/bin; the default is upstream's
# release, the offline build passes a local image holding a tailscaled built from source with Go (with the
# CLI included, see images/tailscale.sh).
ARG BASE=docker.io/library/python:3.11-slim-bookworm
# TAILSCALE_VERSION picks upstream's image, so a Tailscale security release is one rebuild:
# --build-arg TAILSCALE_VERSION=1.102.4 (the offline build builds that tailscaled: images/tailscale.sh).
ARG TAILSCALE_VERSION=1.102.3
ARG TAILSCALE_IMAGE=docker.io/tailscale/tailscale:v${TAILSCALE_VERSION}

FROM ${TAILSCALE_IMAGE} AS tailscale

# ---------------------------------------------------------------------------------------------------------
# build: the project and its Python dependencies in a venv at /opt/venv (same path in the runtime stage, so
# the venv's interpreter link and console scripts stay valid).
FROM ${BASE} AS build
# Debian's python3 splits venv/ensurepip into python3-venv; the official python images include it. apt lists
# are fetched only when it is missing and are removed in the same step (this stage is thrown away anyway).
RUN python3 -c 'import ensurepip, venv' 2>/dev/null || { \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv \
      && rm -rf /var/lib/apt/lists/*; }
# Dependencies first, from pyproject.toml alone: a change to the sources does not re-download them. The
# recorder's extra (h2: version 2 of the recording protocol) too: tsrecorder is an entrypoint of this image.
# The `ca` secret is optional: a CA bundle for a TLS-intercepting proxy between the build and PyPI (the
# offline build passes the host's bundle); it is mounted for this step only and never stored in a layer.
COPY pyproject.toml /src/
RUN --mount=type=secret,id=ca \
    set -e; \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    python3 -m venv /opt/venv; \
    python3 -c 'import tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["recorder"]))' \
      > /tmp/requirements.txt; \
    /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check -q -r /tmp/requirements.txt
COPY README.md VERSION /src/
COPY containerboot /src/containerboot
COPY netfilter /src/netfilter
COPY serveconfig /src/serveconfig
COPY nameserver /src/nameserver
COPY recorder /src/recorder
COPY tscommon /src/tscommon
# --no-deps: the dependencies are installed above. pip byte-compiles everything it installs, which matters: a
# read-only root file system (or PYTHONDONTWRITEBYTECODE) would otherwise make every start compile them.
# pip and setuptools are build tools only: removed from the venv the runtime copies.
RUN --mount=type=secret,id=ca \
    set -e; \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check -q --no-deps /src; \
    /opt/venv/bin/python -m pip uninstall -y -q pip setuptools; \
    rm -rf /opt/venv/bin/pip* /opt/venv/bin/activate* /opt/venv/bin/Activate.ps1 /src

# ---------------------------------------------------------------------------------------------------------
# runtime
FROM ${BASE}
# The agent's system packages: nftables with libnftables (python-nftables loads it), iptables (both the
# legacy and the nft variants are in Debian's package), iproute2, CA certificates for the control server.
# Installed only when the base lacks them; apt's lists and caches go in the same step, else they stay in the
# layer (about 80 MB).
RUN set -e; need=; \
    for p in ca-certificates iproute2 iptables libnftables1 nftables; do \
      dpkg -s "$p" >/dev/null 2>&1 || need="$need $p"; \
    done; \
    if [ -n "$need" ]; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $need; \
      apt-get clean; rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log; \
    fi
COPY --from=build /opt/venv /opt/venv
# tailscaled and tailscale; a tailscaled built with ts_include_cli (the offline build's) is the CLI too when
# called as `tailscale`, and then comes alone: the link below stands for the CLI.
COPY --from=tailscale /usr/local/bin/tailscale* /usr/local/bin/
# k8s-nameserver: the DNSConfig nameserver, and tsrecorder: the Recorder's recorder, other entrypoints of the same
# image (at upstream's binary names).
RUN ln -s /opt/venv/bin/containerboot /usr/local/bin/containerboot \
    && ln -s /opt/venv/bin/k8s-nameserver /usr/local/bin/k8s-nameserver \
    && ln -s /opt/venv/bin/tsrecorder /usr/local/bin/tsrecorder \
    && { [ -e /usr/local/bin/tailscale ] || ln -s tailscaled /usr/local/bin/tailscale; } \
    && /usr/local/bin/tailscale version >/dev/null

ARG VERSION=0.1.0
ARG TAILSCALE_VERSION
LABEL org.opencontainers.image.title="containerboot-py" \
      org.opencontainers.image.description="Tailscale proxy Pod agent (containerboot) in Python, with tailscaled and tailscale" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="BSD-3-Clause" \
      io.tailscale.version="${TAILSCALE_VERSION}"

# Nothing is written under the image's own paths at run time (bytecode is precompiled), so the root file
# system may be read-only; tailscaled's state goes to the Kubernetes Secret or to TS_STATE_DIR on a volume,
# and the sockets to /tmp (TS_SOCKET) and /var/run/tailscale (a tmpfs or emptyDir when read-only).
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# root, like upstream's image: the proxy programs the firewall and a TUN device (NET_ADMIN).
USER root
ENTRYPOINT ["/usr/local/bin/containerboot"]
