"""What can go wrong in `tiergate bench serve`, as one small hierarchy the command reports."""

from __future__ import annotations


class BenchServeError(Exception):
    """The benchmark cannot go on; the message says why."""


class ServerStartError(BenchServeError):
    """A server started by the benchmark exited or did not become ready."""


class ProvisionError(BenchServeError):
    """Tenants or keys could not be created on the server (admin API refused or absent)."""


class BenchConfigError(BenchServeError):
    """The benchmark's own options are inconsistent (bad load list, empty workload, ...)."""
