"""asyncio without `ssl` until something needs TLS: about 4.4 MB of resident memory an agent without TLS never uses.

`import asyncio` imports `ssl` (its event loop and TLS protocol modules bind it at import time), and `ssl` maps
OpenSSL's libssl and libcrypto and builds its tables: about 4.4 MB of a 16 MB interpreter with asyncio, measured
with `python -X importtime` and VmRSS. Most proxy Pods never speak TLS from the agent (an L3 ingress or an
egress proxy without a state Secret talks to tailscaled's LocalAPI over a Unix socket); those that do (the
Kubernetes API, the reachability probe's https URL, the egress pre-shutdown checks) import `ssl` when they first
need it.

`import_asyncio()` imports asyncio while `ssl` cannot be imported (asyncio then binds `ssl = None`, which it
supports), and installs an import hook for `ssl`: the first `import ssl` anywhere in the process, by the agent
or by a library (httpx, anyio), loads the real module and binds it into asyncio's modules again, re-running
`asyncio.sslproto` so that what it derives from `ssl` at import time exists too. From then on asyncio is as if
`ssl` had been there from the start. A process that already imported asyncio or ssl is left alone.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import sys
from types import ModuleType

__all__ = ["import_asyncio", "ssl_deferred"]

_deferred = False


def ssl_deferred() -> bool:
    """True while asyncio was imported without ssl and ssl has not been imported since."""
    return _deferred and "ssl" not in sys.modules


def import_asyncio() -> ModuleType:
    """Import asyncio without ssl (see the module docstring); returns asyncio."""
    global _deferred
    if "asyncio" in sys.modules or "ssl" in sys.modules:
        import asyncio
        return asyncio
    sys.modules["ssl"] = None   # type: ignore[assignment]   # `import ssl` raises ImportError meanwhile
    try:
        import asyncio
    finally:
        del sys.modules["ssl"]
    sys.meta_path.insert(0, _SslFinder())
    _deferred = True
    return asyncio


def _rebind(ssl: ModuleType) -> None:
    """Give every asyncio module that bound `ssl = None` the real module; re-run sslproto's module code."""
    for name, module in list(sys.modules.items()):
        if (name == "asyncio" or name.startswith("asyncio.")) and module is not None \
                and getattr(module, "ssl", False) is None:
            module.ssl = ssl   # type: ignore[attr-defined]
    sslproto = sys.modules.get("asyncio.sslproto")
    if sslproto is not None:
        # Its module code derives names from ssl (the errors to retry on); the loop's modules look its
        # classes up as attributes at call time, and none was used yet (nothing could, without ssl).
        importlib.reload(sslproto)


# Plain classes, not importlib.abc's: that module imports importlib.resources, and with it tempfile, shutil,
# lzma and random (about 1 MB and 25 ms), for an interface the import system only duck-types.
class _SslLoader:
    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _rebind(module)


class _SslFinder:
    """Finds `ssl` through the normal finders once, then wraps its loader so asyncio gets it bound."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "ssl":
            return None
        sys.meta_path.remove(self)   # one-shot: the real import below, and every later one, are ordinary
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _SslLoader(spec.loader)   # type: ignore[assignment]   # duck-typed Loader, see below
        return spec
