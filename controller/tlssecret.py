"""The user's TLS Secret checked as far as the controller can see (docs/https.md), for the parents' pass.

An adapter step, not a kind's decision: besides `tscommon.tlscert`'s reading of the certificate it loads the
pair into the ssl module (`tscommon.tlsload`) to know that the key belongs to it. The answer ("" or why not)
goes to the kind's `decide` (`kindtable.DecideInputs.tls_problem`), which reports it as a Warning.
"""
from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from tscommon import tlscert, tlsload


def tls_problem(secret: Mapping[str, Any] | None, namespace: str, name: str, names: tuple[str, ...],
                now: float, field: str = "spec.tls[].secretName") -> str:
    """Why the Secret cannot be served ("" when it can): missing, wrong type or keys, or tlscert's checks.
    `field`: where the user named it, for the message."""
    ref = f"Secret {namespace}/{name}"
    if secret is None:
        return f"{ref} ({field}) not found: create it, e.g. with cert-manager or kubectl create " \
               "secret tls"
    if secret.get("type") != "kubernetes.io/tls":
        return f"{ref} is of type {secret.get('type')!r}: the proxy serves only kubernetes.io/tls Secrets"
    data = secret.get("data") or {}
    try:
        crt, key = base64.b64decode(data.get("tls.crt") or ""), base64.b64decode(data.get("tls.key") or "")
        tlscert.check(crt, key, names, now)
        tlsload.key_matches(crt, key)
    except (binascii.Error, ValueError) as e:     # CertProblem is a ValueError
        return f"{ref}: {e}"
    return ""
