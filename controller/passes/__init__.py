"""The passes (shell): one per kind of queue key, peers that share one `writer.Writer`.

Each pass is a class built with the writer and has `async run(kind, namespace, name) -> float | None`
(seconds until the next check, None to wait for an event; it raises on API or control-plane errors and the
queue retries with backoff). `controller.reconcile.Reconciler` builds them and dispatches a key through
`kindtable.KINDS[kind].runs`.
A pass reads the API server, computes with the pure modules (`kinds/`, `render`, `pgrender`, `proxyclass`,
`dnsconfig`, `status`) and writes what differs through the writer. Passes call each other's public methods
only, in one direction: parents → egress → proxygroup; proxyclass, dnsconfig and recorder stand alone.
"""
