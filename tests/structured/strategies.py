"""Hypothesis strategies of JSON Schemas whose documents are bounded (strings, arrays and
integers have limits, objects no extra keys), so that a random model completes every one."""
from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

KEYS = st.from_regex(r"[a-z][a-z_]{0,5}", fullmatch=True)


def _object(props: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.sets(st.sampled_from(sorted(props))).map(
        lambda required: {"type": "object", "properties": props, "required": sorted(required),
                          "additionalProperties": False})


LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 5000)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.lists(st.text("abc xyz-", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
        lambda xs: {"enum": xs}),
    st.builds(lambda n: {"type": "string", "pattern": f"^[a-f0-9]{{{n}}}$"}, st.integers(1, 6)),
)


def _compound(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)),
        st.dictionaries(KEYS, children, min_size=1, max_size=3).flatmap(_object),
        st.lists(children, min_size=2, max_size=3).map(lambda xs: {"anyOf": xs}),
    )


SCHEMAS = st.recursive(LEAVES, _compound, max_leaves=6)
# an object at the top, as response_format json_schema asks in practice
OBJECT_SCHEMAS = st.dictionaries(KEYS, SCHEMAS, min_size=1, max_size=3).flatmap(_object)


def documents(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Documents valid under `schema` (one of the schemas above), keys in the schema's order
    (llguidance writes and reads properties in that order, as OpenAI's strict mode does)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([documents(s) for s in schema["anyOf"]])
    kind = schema["type"]
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "integer":
        return st.integers(schema["minimum"], schema["maximum"])
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"].strip("^$"), fullmatch=True)
        return st.text(max_size=schema["maxLength"])
    if kind == "array":
        return st.lists(documents(schema["items"]), max_size=schema["maxItems"])
    props = schema["properties"]
    optional = [k for k in props if k not in schema["required"]]
    return st.sets(st.sampled_from(optional) if optional else st.nothing()).flatmap(
        lambda chosen: st.fixed_dictionaries(
            {k: documents(props[k]) for k in props if k in chosen or k in schema["required"]}
        ).map(lambda d: {k: d[k] for k in props if k in d}))  # the schema's order
