"""What an anonymous scrape of /metrics may see: every series with the tenant label folded
away (summed over tenants), so per-tenant usage is not shown to whoever can reach the port.
The full registry, tenant labels included, is served to the admin credential only
(`/admin/v1/metrics`)."""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

TENANT_LABEL = "tenant"


class _WithoutTenants(Collector):
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if not any(TENANT_LABEL in sample.labels for sample in family.samples):
                yield family
                continue
            folded: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for sample in family.samples:
                labels = tuple(sorted(
                    (name, value) for name, value in sample.labels.items()
                    if name != TENANT_LABEL
                ))
                key = (sample.name, labels)
                if sample.name.endswith("_created"):  # when the series began: the earliest
                    folded[key] = min(folded.get(key, math.inf), sample.value)
                else:
                    folded[key] = folded.get(key, 0.0) + sample.value
            view = Metric(family.name, family.documentation, family.type, family.unit)
            for (name, labels), value in folded.items():
                view.add_sample(name, dict(labels), value)
            yield view


def without_tenants(registry: CollectorRegistry) -> CollectorRegistry:
    """A registry that reads registry at each scrape, the tenant label summed away."""
    view = CollectorRegistry(auto_describe=False)
    view.register(_WithoutTenants(registry))
    return view
