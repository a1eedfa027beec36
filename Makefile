# The two commands of the README: `make demo` (the main job) and `make test` (every test).
SHELL := /bin/bash
PY := .venv/bin/python
export CB_BIN_DIR ?= $(shell bash scripts/install-binaries.sh --print-dir 2>/dev/null)

.PHONY: test-ecosystem compat setup setup-bin image images images-archives release release-check chart demo test test-unit test-netns bench clean-lab readme modulemap figures manifests check fuzz outages hostile crash

setup:
	@bash scripts/setup.sh

setup-bin:
	@bash scripts/setup.sh --binaries

# The netns tests run the proxy image (netns-tests/test_image_e2e.py) and the controller's
# (test_controller_realkube_e2e.py): build both first (idempotent). Without podman they are skipped, except
# under CI, where that is a failure.
# Image names and archives are one per machine, shared by every checkout: LAB_PROXY_IMAGE and
# LAB_CONTROLLER_IMAGE (e.g. localhost/containerboot-py:<branch>) give a checkout its own (docs/lab-and-tests.md).
LAB_PROXY_IMAGE ?= localhost/containerboot-py:latest
LAB_CONTROLLER_IMAGE ?= localhost/containerboot-py-controller:latest
export LAB_PROXY_IMAGE LAB_CONTROLLER_IMAGE
CONTROLLER_IMAGE = bash images/build.sh --dockerfile images/controller/Dockerfile --name $(LAB_CONTROLLER_IMAGE)
MAKE_IMAGE = bash scripts/setup.sh --image && bash images/build.sh --name $(LAB_PROXY_IMAGE) && $(CONTROLLER_IMAGE) || [ -z "$$CI" ]

## image: the proxy image localhost/containerboot-py:latest from the Dockerfile, offline, plus its OCI archive
## (path: bash images/build.sh --print-archive). Cached: nothing changed, nothing rebuilt. See images/README.md.
## TAILSCALE_VERSION=1.102.x builds it with that tailscale (give it its own LAB_PROXY_IMAGE name).
image: setup-bin
	@bash scripts/setup.sh --image
	@$(if $(TAILSCALE_VERSION),TS_VER=v$(TAILSCALE_VERSION)) bash images/build.sh --name $(LAB_PROXY_IMAGE)

# Images for a registry (docs/install-headscale.md, step 1). TAG defaults to the chart's appVersion.
REGISTRY ?=
TAG ?=
LOCAL_BASES ?=
REGISTRY_CERT_DIR ?=
REGISTRY_AUTHFILE ?=
PLATFORMS ?= linux/amd64,linux/arm64
TOOL ?=
RELEASE_ARGS = --registry "$(REGISTRY)" $(if $(TAG),--tag "$(TAG)") --platforms "$(PLATFORMS)"

## images: both images (proxy, controller) for PLATFORMS as REGISTRY/<name>:TAG, pushed (docker buildx, else
## podman manifest lists; TOOL=docker|podman chooses). With podman: LOCAL_BASES=1 builds on this machine's
## bases instead of Docker Hub's; REGISTRY_CERT_DIR / REGISTRY_AUTHFILE for a private registry.
images:
	@[ -n "$(REGISTRY)" ] || { echo "make images needs REGISTRY=<registry/path>, e.g. REGISTRY=registry.example.com/tailscale" >&2; exit 2; }
	bash images/release.sh $(RELEASE_ARGS) --push $(if $(TOOL),--tool "$(TOOL)") $(if $(LOCAL_BASES),--local-bases) \
	  $(if $(REGISTRY_CERT_DIR),--cert-dir "$(REGISTRY_CERT_DIR)") $(if $(REGISTRY_AUTHFILE),--authfile "$(REGISTRY_AUTHFILE)")

## images-archives: the same without a registry: one OCI archive per image and platform (foreign ones under
## qemu user mode), then their checks (tests/test_image_archives.py). REGISTRY defaults to a placeholder.
images-archives: REGISTRY := $(or $(REGISTRY),registry.example.com/tailscale)
images-archives: setup-bin
	@bash scripts/setup.sh --image --multiarch
	bash images/release.sh $(RELEASE_ARGS) --offline
	CB_RELEASE_DIR="$$(bash images/release.sh $(RELEASE_ARGS) --print-out)" CB_RELEASE_REGISTRY="$(REGISTRY)" \
	  CB_RELEASE_PLATFORMS="$(PLATFORMS)" $(PY) -m pytest -q tests/test_image_archives.py

## release: VERSION (default: the file VERSION, which it must equal) released to REGISTRY: both images for PLATFORMS
## as multi-arch indexes and the chart (version = appVersion = VERSION, images pinned by tag and digest) as
## oci://REGISTRY/charts/tailscale-controller. REGISTRY_CERT_DIR (a directory with ca.crt) and REGISTRY_AUTHFILE
## (podman's/helm's auth file) for a private registry; TAILSCALE_VERSION=1.102.x for another tailscale. See
## docs/install-gitops.md, "The release flow".
VERSION ?=
TAILSCALE_VERSION ?=
release: setup-bin
	@[ -n "$(REGISTRY)" ] || { echo "make release needs REGISTRY=<registry/path>, e.g. REGISTRY=registry.example.com/tailscale" >&2; exit 2; }
	@bash scripts/setup.sh --image $(if $(findstring arm64,$(PLATFORMS)),--multiarch)
	$(if $(TAILSCALE_VERSION),TS_VER=v$(TAILSCALE_VERSION)) bash scripts/release.sh --registry "$(REGISTRY)" \
	  $(if $(VERSION),--version "$(VERSION)") --platforms "$(PLATFORMS)" \
	  $(if $(REGISTRY_CERT_DIR),--cert-dir "$(REGISTRY_CERT_DIR)") $(if $(REGISTRY_AUTHFILE),--authfile "$(REGISTRY_AUTHFILE)")

## chart: the packaged chart, dist/tailscale-controller-<version>.tgz (helm package).
chart: setup-bin
	@mkdir -p dist
	$$(bash scripts/install-helm.sh --print-dir)/helm package charts/tailscale-controller --destination dist

## demo: a local tailnet in network namespaces with the agent exposing a backend (root). Each variant builds only
## what it uses: the plain demo tailscaled, tailscale and headscale; --agent upstream upstream containerboot too;
## --kube, --controller, --proxygroup, --dns and --apiserver-proxy Kubernetes too (their images are built by the
## demo itself); --controller --https helm and cert-manager too; --gitops also helm, the registry and Flux
## (`make release` builds the images, amd64 unless CB_RELEASE_PLATFORMS says otherwise).
DEMO_PARTS = tailscale$(if $(findstring upstream,$(DEMO_ARGS)),$(COMMA)upstream)$(if $(or $(findstring --kube,$(DEMO_ARGS)),$(findstring --controller,$(DEMO_ARGS)),$(findstring --proxygroup,$(DEMO_ARGS)),$(findstring --dns,$(DEMO_ARGS)),$(findstring --apiserver-proxy,$(DEMO_ARGS)),$(findstring --gitops,$(DEMO_ARGS))),$(COMMA)kubernetes)$(if $(findstring --https,$(DEMO_ARGS)),$(COMMA)helm$(COMMA)cert-manager)$(if $(findstring --gitops,$(DEMO_ARGS)),$(COMMA)helm$(COMMA)registry$(COMMA)flux)
COMMA := ,
demo: setup
	@bash scripts/setup.sh --binaries=$(DEMO_PARTS)$(if $(findstring --gitops,$(DEMO_ARGS)), --image)
	$(if $(findstring --image,$(DEMO_ARGS)),bash scripts/setup.sh --image && bash images/build.sh --name $(LAB_PROXY_IMAGE))
	$(PY) -m labtools.demo $(DEMO_ARGS)

# Both suites run on PYTEST_WORKERS pytest-xdist workers (0: in one process, as plain pytest does). The unit
# tests are handed out test by test; the netns tests module by module (--dist loadfile: a module's lab or cluster
# is made once, on one worker), longest modules first (the order in netns-tests/conftest.py, kept by
# --no-loadscope-reorder). docs/lab-and-tests.md has the figures.
# -rs lists every skip with its reason; under CI a skip not in tests/expected-skips.txt fails the run.
PYTEST_WORKERS ?= 2
UNIT_ARGS = -rs -n $(PYTEST_WORKERS)
NETNS_ARGS = -rs -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not ecosystem"

## test: unit tests (no root, no network), then the namespace and end-to-end tests (root).
# The release tests (netns-tests/test_release_*.py) build and push the images for these platforms. The suite
# builds amd64 only: a cold arm64 build runs under qemu for tens of minutes on two cores, which CI's time cannot
# hold; `make release-check` runs the same tests for both platforms (the arm64 index entries checked).
CB_RELEASE_PLATFORMS ?= linux/amd64
export CB_RELEASE_PLATFORMS

test: setup-bin
	$(PY) -m pytest -q $(UNIT_ARGS) tests
	@$(MAKE_IMAGE)
	$(PY) -m pytest -q -p no:cacheprovider $(NETNS_ARGS) netns-tests

test-unit: setup
	$(PY) -m pytest -q $(UNIT_ARGS) tests

test-netns: setup-bin
	@$(MAKE_IMAGE)
	$(PY) -m pytest -q $(NETNS_ARGS) netns-tests

## test-ecosystem: the tests that run other projects' controllers in the lab's real cluster, as their installs
## run them: Flux installing, upgrading and removing the chart from a release in the lab's registry
## (netns-tests/test_flux_realkube.py) and cert-manager issuing the certificates an Ingress and the API server
## proxy serve (netns-tests/test_certmanager_e2e.py). Not part of `make test`: their Go builds take about an
## hour cold on 2 cores, past CI's budget for a cold run (docs/lab-and-tests.md).
test-ecosystem: setup-bin
	@bash scripts/setup.sh --binaries=flux,cert-manager
	@$(MAKE_IMAGE)
	$(PY) -m pytest -q -p no:cacheprovider -rs -n $(PYTEST_WORKERS) --dist loadfile -m ecosystem \
		netns-tests/test_flux_realkube.py netns-tests/test_certmanager_e2e.py

## release-check: the release tests for linux/amd64 and linux/arm64 (the arm64 entry of each index checked:
## platform, digest, its config's architecture), arm64 built under qemu (root).
release-check: setup-bin
	@bash scripts/setup.sh --image --multiarch
	CB_RELEASE_PLATFORMS=linux/amd64,linux/arm64 $(PY) -m pytest -q -p no:cacheprovider netns-tests/test_release_registry.py \
		netns-tests/test_release_realkube.py

## fuzz: the long run of the generated-input tests (tests/test_fuzz_*.py): random seeds, FUZZ_EXAMPLES examples
## a target (default 20000; `make test` runs 100 drawn from the run's printed seed, CB_SEED). A failure prints the input that shows it.
FUZZ_EXAMPLES ?= 20000
fuzz: setup
	CB_FUZZ_PROFILE=fuzz CB_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q \
		--hypothesis-show-statistics tests/test_fuzz_agent.py tests/test_fuzz_controller.py \
		tests/test_fuzz_dns_and_grants.py

## outages: the outage tests (netns-tests/test_outages.py, and the controller's API-server outage in
## netns-tests/test_controller_apiserver.py) with five-minute outages instead of the suite's 20 s, each starting
## at a time drawn from the run's seed (CB_SEED); the figures (data path gap, recovery) go to outages.jsonl and,
## as their rows, to bench/results/outages.json and the docs (root).
outages: setup-bin
	BENCH_RECORD=1 OUTAGE_SECONDS=300 CB_OUTAGE_REPORT=outages.jsonl $(PY) -m pytest -q -s -p no:cacheprovider netns-tests/test_outages.py \
		netns-tests/test_controller_apiserver.py -k "outage or down"

## crash: every crash point of the agent after boot (both firewall backends) and of the controller against a
## real headscale (netns-tests/test_agent_crash_steady.py, test_controller_crash_headscale.py); `make test` tries
## a sample of them (drawn from the run's seed, CB_SEED). The boot's points (test_agent_crash.py) are all in `make test` (root).
crash: setup-bin
	CB_CRASH_ALL=1 $(PY) -m pytest -q -s -p no:cacheprovider netns-tests/test_agent_crash_steady.py \
		netns-tests/test_controller_crash_headscale.py

## hostile: the controller under a hostile API server with 500 Services instead of the suite's 60 and 30: the
## in-memory one (tests/test_controller_hostile_api.py), then the real kube-apiserver behind labtools.faultproxy
## with the conflict webhook (netns-tests/test_controller_hostile_apiserver.py, root, a 30 s quiet window); prints
## convergence time, requests per Service, faults and warning lines, and records them as the 500-Service
## columns of bench/results/hostile.json and the docs. The faults are drawn from the run's seed (CB_SEED).
hostile: setup-bin
	BENCH_RECORD=1 HOSTILE_SERVICES=500 $(PY) -m pytest -q -s -p no:cacheprovider tests/test_controller_hostile_api.py
	BENCH_RECORD=1 HOSTILE_SERVICES=500 HOSTILE_QUIET=30 $(PY) -m pytest -q -s -p no:cacheprovider \
		netns-tests/test_controller_hostile_apiserver.py

## bench: boot time, rule programming and footprint against upstream containerboot, measured in the same run (root).
bench: setup-bin
	$(PY) -m bench.boot
	$(PY) -m bench.rules
	$(PY) -m bench.controller
	$(PY) -m bench.footprint
	$(PY) -m bench.dns

## compat: headscale's version matrix (docs/install-headscale.md, "headscale versions"): for each of
## HEADSCALE_VERSIONS (default v0.26.1,v0.27.1,v0.28.0,v0.29.2; each built once) the controller's provider, a real
## tailscaled, the proxies' e2e tests and the controller's user story in one shared cluster against that headscale;
## prints the table, records the REST answers for the unit tests (tests/data/headscale/) and, on the full matrix,
## the table (bench/results/compat.json) rendered into the docs (root). --check: fail on a failed step or on a cell
## whose verdict differs from the docs' table.
COMPAT_ARGS ?= --e2e --record tests/data/headscale --write-docs
compat: setup-bin
	$(PY) -m labtools.hsmatrix compat $(COMPAT_ARGS)

## clean-lab: remove namespaces left by an interrupted lab run (only ones this project created).
clean-lab:
	$(PY) -m labtools.kubecluster reap-stale
	$(PY) -m labtools.lab reap-stale

## readme: regenerate the variable reference in docs/agent.md from the settings table.
readme: setup
	$(PY) scripts/update_readme.py

## modulemap: regenerate the module map in docs/modules.md from the modules' docstrings (scripts/modulemap.py).
modulemap: setup
	$(PY) scripts/modulemap.py --write

## figures: render the benchmarks' recorded figures (bench/results/*.json) into docs/ (scripts/render_figures.py).
figures: setup
	$(PY) scripts/render_figures.py --write

## manifests: render deploy/ (kubectl apply -R -f deploy/) from the chart charts/tailscale-controller with helm.
manifests: setup-bin
	$(PY) -m labtools.helmchart write

## check: the static gate: ruff (lint, the whole tree), mypy (types, the product's packages), as configured in
## pyproject.toml, the import structure's rules (tests/test_layers.py: layers, pure modules, no circle) and
## the test code's sleeps (tests/test_sleepcheck.py: each one says why it is not a wait). CI runs it before the tests.
check: setup
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py tests/test_sleepcheck.py
