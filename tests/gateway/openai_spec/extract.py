"""Write the part of OpenAI's OpenAPI spec that tiergate serves (createChatCompletion,
createCompletion, listModels, createResponse and every schema they reference) next to this
file.

    python tests/gateway/openai_spec/extract.py PATH/TO/openai-openapi.yaml

The subset keeps the schemathesis test fast (the full spec is 3 MB) and lets it run from
any checkout. Source: openai/openai-openapi (MIT, see LICENSE here).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

OPERATIONS = {
    ("/chat/completions", "post"), ("/completions", "post"), ("/models", "get"),
    ("/responses", "post"),
}
OUTPUT = Path(__file__).with_name("openai-subset.json")


def _refs(node: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            found.add(ref)
        for value in node.values():
            found |= _refs(value)
    elif isinstance(node, list):
        for value in node:
            found |= _refs(value)
    return found


def extract(spec: dict[str, Any]) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for path, method in OPERATIONS:
        operation = dict(spec["paths"][path][method])
        operation.pop("x-oaiMeta", None)
        paths.setdefault(path, {})[method] = operation
    components: dict[str, dict[str, Any]] = {}
    pending = _refs(paths)
    seen: set[str] = set()
    while pending:
        ref = pending.pop()
        if ref in seen:
            continue
        seen.add(ref)
        _, _, kind, name = ref.split("/", 3)
        node = spec["components"][kind][name]
        components.setdefault(kind, {})[name] = node
        pending |= _refs(node)
    return {
        "openapi": spec["openapi"],
        "info": spec["info"],
        "servers": spec.get("servers", []),
        "security": spec.get("security", []),
        "paths": paths,
        "components": {**components, "securitySchemes": spec["components"]["securitySchemes"]},
    }


if __name__ == "__main__":
    source = yaml.safe_load(Path(sys.argv[1]).read_text())
    OUTPUT.write_text(json.dumps(extract(source), indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUTPUT}")
