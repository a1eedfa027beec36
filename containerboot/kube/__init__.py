"""The agent's Kubernetes side: the in-cluster client (`client`), its state Secret as pure patches
(`secretstate`), RBAC checks and the reissue flow (`setup`), and the boot/steady-state glue (`state`)."""
