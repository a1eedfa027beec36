"""The thin companion controller: Kubernetes Services, Ingresses and Connectors become proxy Pods.

Layout mirrors the agent: `config` (pure, the controller's settings), `validation` and `kinds/` (pure: parent
object → `model.ProxySpec` or an `Invalid` reason), `render` (pure: ProxySpec → StatefulSet, config/state
Secrets, headless Service), `status` (pure: state Secret keys → parent status), `providers/` (control plane
adapters: headscale, Tailscale, a static key), `kubeapi` (small httpx client), `reconcile` (one level-triggered
pass per parent: decide, apply what differs, report) and `handlers` (kopf: watches, the work queue).
"""
