"""LoRA adapters as tenant resources: their files (uploaded archives, server paths, the
content-addressed local store), the registry that resolves a request's `model` to an adapter
its tenant may use, and unregistering once the requests on an adapter have ended.
"""

from gateway.adapters.archive import AdapterFiles, read_archive, read_directory
from gateway.adapters.registry import AdapterRegistry, ModelTarget, PinLimitError
from gateway.adapters.store import AdapterStore, content_hash

__all__ = [
    "AdapterFiles",
    "AdapterRegistry",
    "AdapterStore",
    "ModelTarget",
    "PinLimitError",
    "content_hash",
    "read_archive",
    "read_directory",
]
