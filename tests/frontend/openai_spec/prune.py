"""Prune OpenAI's published OpenAPI document (github.com/openai/openai-openapi, openapi.json)
to the three operations pdserve serves: POST /chat/completions, POST /completions, GET /models.

    python tests/frontend/openai_spec/prune.py path/to/openapi.json tests/frontend/openai_spec/openapi.json

Kept: those operations, every component (schema, response) they reach through $ref, the API-key security
scheme. Dropped: the rest, and the documentation-only `x-oaiMeta` blocks. Nothing is edited.
"""
from __future__ import annotations

import json
import sys
from typing import Any

OPERATIONS = {"/chat/completions": "post", "/completions": "post", "/models": "get"}
REF = "#/components/"


def refs(node: Any) -> set[tuple[str, str]]:
    """The (kind, name) of every `#/components/<kind>/<name>` reference under `node`."""
    found: set[tuple[str, str]] = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(REF):
            kind, name = ref[len(REF):].split("/", 1)
            found.add((kind, name))
        for value in node.values():
            found |= refs(value)
    elif isinstance(node, list):
        for value in node:
            found |= refs(value)
    return found


def without_meta(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: without_meta(v) for k, v in node.items() if k != "x-oaiMeta"}
    if isinstance(node, list):
        return [without_meta(v) for v in node]
    return node


def prune(spec: dict[str, Any]) -> dict[str, Any]:
    paths = {path: {method: spec["paths"][path][method]} for path, method in OPERATIONS.items()}
    components = spec["components"]
    keep: set[tuple[str, str]] = set()
    todo = refs(paths)
    while todo:
        kind, name = todo.pop()
        if (kind, name) not in keep:
            keep.add((kind, name))
            todo |= refs(components[kind][name]) - keep
    kept: dict[str, dict[str, Any]] = {}
    for kind, name in sorted(keep):
        kept.setdefault(kind, {})[name] = components[kind][name]
    kept["securitySchemes"] = {"ApiKeyAuth": components["securitySchemes"]["ApiKeyAuth"]}
    pruned = {"openapi": spec["openapi"], "info": spec["info"], "servers": spec["servers"],
              "security": spec.get("security", []), "paths": paths, "components": kept}
    return without_meta(pruned)


def main(source: str, target: str) -> None:
    with open(source, encoding="utf-8") as f:
        spec = json.load(f)
    with open(target, "w", encoding="utf-8") as f:
        json.dump(prune(spec), f, indent=1, sort_keys=False)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
