"""Test hook: stop the process with SIGKILL just before a chosen write, to test what a restart finds.

Off unless CB_TEST_CRASH_LOG or CB_TEST_CRASH_AT is set; then each write site calls `hit(name)` right before it
writes: in the agent a state Secret patch, a rule set applied to the kernel, a serve config posted to
tailscaled, the steps of the auth key reissue; in the controller each write to the Kubernetes API and each
write to the control plane (an auth key minted, a device deleted, a device's tags set). With
CB_TEST_CRASH_LOG=<path> every hit is appended to that file as "<name> <n>" (the
n-th hit of that name in this process), which is how a test enumerates the crash points of a run; with
CB_TEST_CRASH_AT=<name>:<n> the n-th hit of <name> kills the process (SIGKILL: no clean-up, no flush, like
the OOM killer or a node losing power). Nothing else reads these variables.
"""
from __future__ import annotations

import os
import signal
from collections import Counter

_LOG = os.environ.get("CB_TEST_CRASH_LOG", "")
_AT = os.environ.get("CB_TEST_CRASH_AT", "")
_counts: Counter[str] = Counter()

# The names of the write sites, for the tests and the docs.
SECRET_WRITE = "secret-write"
RULES_APPLY = "rules-apply"
SERVE_APPLY = "serve-apply"
REISSUE_REQUEST = "reissue-request"
REISSUE_CLEAR = "reissue-clear"
# The controller's.
KUBE_WRITE = "kube-write"          # create, patch or delete of any object (controller.kubeapi.Kube)
KEY_MINT = "key-mint"              # a provider creating an auth key
DEVICE_DELETE = "device-delete"    # a provider deleting a device
DEVICE_TAGS = "device-tags"        # a provider replacing a device's tags


def hit(name: str) -> None:
    """A write named `name` is about to happen."""
    if not (_LOG or _AT):
        return
    _counts[name] += 1
    point = f"{name} {_counts[name]}"
    if _LOG:
        with open(_LOG, "a", encoding="utf-8") as f:
            f.write(point + "\n")
    if _AT == f"{name}:{_counts[name]}":
        os.kill(os.getpid(), signal.SIGKILL)
