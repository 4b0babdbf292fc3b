"""Deployment and operations files (Docker, Kubernetes, Prometheus, Grafana).

Only ``ops.local_cluster`` is Python: N ``tiergate serve`` replicas on loopback ports behind a
round-robin proxy, importable by tests and runnable as ``python -m ops.local_cluster``.
"""
