"""DSML tag headers: the bytes between the DSML id and the first `>` (spec §2.4.3–4).

The header is lexed from bytes, never from token ids, because BPE groups these bytes in many
ways (`">`, `">\\n`, `"></`). Strict mode accepts exactly the reference encoder's shapes;
lenient mode also accepts extra whitespace, any known block name and a missing `string=`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

MAX_TAG_BYTES = 512
BLOCK_NAMES = ("function_calls", "tool_calls", "calls")

_WS = " \t\r\n"
_STRICT_INVOKE = re.compile(r'invoke name="([^"]*)"\Z')
_STRICT_PARAM = re.compile(r'parameter name="([^"]*)" string="(true|false)"\Z')
_WORD = re.compile(r"([A-Za-z_]+)(.*)\Z", re.S)
_ATTRS = re.compile(r'(?:[ \t\r\n]+[A-Za-z_]+="[^"]*")*[ \t\r\n]*\Z')
_ATTR = re.compile(r'([A-Za-z_]+)="([^"]*)"')


class TagKind(Enum):
    BLOCK = "block"
    INVOKE = "invoke"
    PARAM = "parameter"
    UNKNOWN = "unknown"


class ValueKind(Enum):
    STRING = "string"  # string="true": verbatim text, streamed as a JSON string
    JSON = "json"      # string="false": raw JSON spliced verbatim once it validates
    AUTO = "auto"      # no string= attribute (lenient): JSON if it parses, else a string


@dataclass(frozen=True)
class Tag:
    kind: TagKind
    closing: bool
    name: str = ""
    value: ValueKind = ValueKind.AUTO
    raw: str = ""

    def describe(self) -> str:
        return ("</" if self.closing else "<") + self.raw + ">"


def lex_header(raw: bytes, closing: bool, block_name: str, strict: bool) -> Tag:
    text = raw.decode("utf-8", "replace")
    tag = _strict(text, closing, block_name) if strict else _lenient(text, closing)
    return Tag(tag.kind, closing, tag.name, tag.value, text)


def _strict(text: str, closing: bool, block_name: str) -> Tag:
    if text == block_name:
        return Tag(TagKind.BLOCK, closing)
    if closing:
        kinds = {"invoke": TagKind.INVOKE, "parameter": TagKind.PARAM}
        return Tag(kinds.get(text, TagKind.UNKNOWN), closing)
    if m := _STRICT_INVOKE.match(text):
        return Tag(TagKind.INVOKE, closing, m.group(1))
    if m := _STRICT_PARAM.match(text):
        value = ValueKind.STRING if m.group(2) == "true" else ValueKind.JSON
        return Tag(TagKind.PARAM, closing, m.group(1), value)
    return Tag(TagKind.UNKNOWN, closing)


def _lenient(text: str, closing: bool) -> Tag:
    m = _WORD.match(text.strip(_WS))
    if m is None:
        return Tag(TagKind.UNKNOWN, closing)
    word, rest = m.group(1), m.group(2)
    if word in BLOCK_NAMES:
        kind = TagKind.BLOCK
    elif word in ("invoke", "parameter"):
        kind = TagKind.INVOKE if word == "invoke" else TagKind.PARAM
    else:
        return Tag(TagKind.UNKNOWN, closing)
    if closing or kind is TagKind.BLOCK:
        return Tag(kind if not rest.strip(_WS) else TagKind.UNKNOWN, closing)
    if not _ATTRS.match(rest):
        return Tag(TagKind.UNKNOWN, closing)
    attrs = dict(_ATTR.findall(rest))
    if "name" not in attrs:
        return Tag(TagKind.UNKNOWN, closing)
    value = {"true": ValueKind.STRING, "false": ValueKind.JSON}.get(attrs.get("string", ""), ValueKind.AUTO)
    return Tag(kind, closing, attrs["name"], value)
