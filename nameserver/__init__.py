"""The cluster nameserver for MagicDNS names (the DNSConfig resource's nameserver).

Cluster workloads that must reach a tailnet service by its MagicDNS name (its certificate is for that name)
ask CoreDNS, which forwards the tailnet's domain (a stub zone) to this server. The controller keeps the
records in a ConfigMap (``records.json``: ``{"version": "v1alpha1", "ip4": {name: [ips]}, "ip6": {...}}``)
mounted into the nameserver's Pod; the server reloads it when the kubelet swaps the mount.

- ``records``: the records file -> ``Records`` (pure; a bad file is an error naming what is wrong).
- ``answer``: a query's wire bytes + records + zones -> the answer's wire bytes (pure).
- ``server``: the UDP and TCP listeners and the records file watch (the shell).
"""
