"""Tokenizer wrapper, chat templates, and an incremental detokenizer.

The router owns text: it encodes prompts, renders chat templates and turns the decode workers'
token ids back into text. Parsers work on token ids and need the raw bytes each token stands
for (``token_bytes``), so the byte table is built once from the ``tokenizer.json`` decoder rules.
``IncrementalDetokenizer`` streams text from those bytes in O(1) per token and its output,
concatenated, is exactly ``Tokenizer.decode`` of all the ids.
"""
from __future__ import annotations

import codecs
import dataclasses
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

logger = logging.getLogger(__name__)

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte→printable-character map used by byte-level BPE vocabularies."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + shift)] = b
            shift += 1
    return mapping


_UNICODE_TO_BYTE = gpt2_unicode_to_byte()
# str.translate table: stand-in character -> the byte it encodes (as a latin-1 character).
# Unmapped characters in U+0080..U+00FF must not pass through as one latin-1 byte (their UTF-8
# is two bytes), so they map to a character latin-1 cannot encode, forcing the slow path.
_BYTE_LEVEL_TRANSLATION = {
    **{c: "\U0010ffff" for c in range(0x80, 0x100)},
    **{ord(ch): b for ch, b in _UNICODE_TO_BYTE.items()},
}


@dataclasses.dataclass(frozen=True)
class DecoderRules:
    """What the ``tokenizer.json`` decoder does, reduced to what matters for token bytes."""

    byte_level: bool = False
    replacements: tuple[tuple[str, str], ...] = ()
    byte_fallback: bool = False
    strip_output: int = 0  # Strip decoder after Fuse: drop up to N leading spaces of the text
    first_token_marker: str | None = None  # Metaspace: the first token loses every marker
    supported: bool = True


def decoder_rules(decoder: Mapping[str, Any] | None) -> DecoderRules:
    """Read the decoder section of ``tokenizer.json`` (ByteLevel, Metaspace, SPM sequences)."""
    rules = DecoderRules()
    for step in _flatten(decoder):
        kind = step.get("type")
        if kind == "ByteLevel":
            rules = dataclasses.replace(rules, byte_level=True)
        elif kind == "Replace" and "String" in step.get("pattern", {}):
            pair = (step["pattern"]["String"], step["content"])
            rules = dataclasses.replace(rules, replacements=(*rules.replacements, pair))
        elif kind == "ByteFallback":
            rules = dataclasses.replace(rules, byte_fallback=True)
        elif kind == "Fuse":
            pass
        elif kind == "Strip" and step.get("content") == " " and not step.get("stop"):
            rules = dataclasses.replace(rules, strip_output=int(step.get("start", 0)))
        elif kind == "Metaspace":
            marker = step.get("replacement", "\u2581")
            prepend = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
            rules = dataclasses.replace(
                rules,
                replacements=(*rules.replacements, (marker, " ")),
                first_token_marker=None if prepend == "never" else marker,
            )
        else:
            logger.warning("decoder %r is not modelled; token_bytes falls back to decode()", kind)
            rules = dataclasses.replace(rules, supported=False)
    return rules


def _flatten(decoder: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [step for child in decoder["decoders"] for step in _flatten(child)]
    return [decoder]


class Tokenizer:
    """A Hugging Face model directory's tokenizer: ids, bytes, special tokens, chat template."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        self._tok = HFTokenizer.from_file(str(path))
        self.config = _read_json(self.model_dir / "tokenizer_config.json")
        generation = _read_json(self.model_dir / "generation_config.json")
        spec = json.loads(path.read_text(encoding="utf-8"))  # parsed once: ~0.15 s per parse (SmolLM2)
        self.rules = decoder_rules(spec.get("decoder"))
        self._added = self._tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, tok in self._added.items() if tok.special)
        self.added_token_ids = frozenset(self._added)  # special or not (llguidance_backend.py)
        self.vocab_size = max(
            self._tok.get_vocab_size(with_added_tokens=True), max(self._added, default=-1) + 1
        )
        self._build_byte_tables(spec.get("model", {}).get("vocab"))
        self.max_token_bytes = max(1, max((len(b) for b in self._bytes), default=1))
        self._bounded = _length_is_bounded(spec)
        self.cut_tokens = _cut_tokens(spec)
        self.framing = _framing(spec.get("post_processor"))  # a text completion's special tokens
        self.special_tokens_map = {
            key: tok for key in _SPECIAL_TOKEN_KEYS if (tok := _token_text(self.config.get(key)))
        }
        self.bos_token_id = self._special_id("bos_token", generation.get("bos_token_id"))
        self.eos_token_id = self._special_id("eos_token", generation.get("eos_token_id"))
        stops = set(_as_list(generation.get("eos_token_id")))
        if self.eos_token_id is not None:
            stops.add(self.eos_token_id)
        self.stop_token_ids = frozenset(stops)
        self.chat_templates = _load_chat_templates(self.model_dir, self.config)

    # ---- ids and text -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of `text`. Long texts go through ``encode_batch``, which gives the same ids
        and releases the GIL while it works (``encode`` holds it even in a thread): a big
        prompt tokenized off the router's event loop does not stall the loop."""
        if len(text) <= _INLINE_ENCODE_CHARS:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_with_ends(self, text: str) -> tuple[list[int], list[int]]:
        """The ids of `text` (no special tokens added) and where each token ends in it (a
        character offset)."""
        if len(text) <= _INLINE_ENCODE_CHARS:
            enc = self._tok.encode(text, add_special_tokens=False)
        else:
            enc = self._tok.encode_batch([text], add_special_tokens=False)[0]
        return enc.ids, [end for _, end in enc.offsets]

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` without tokenizing: no token stands for more
        than ``max_token_bytes`` bytes, and a normalizer shrinks a character's UTF-8 at most
        ``_NORMALIZER_SHRINK`` times. 0 for tokenizers whose rules can drop text (whitespace
        splitting, accent stripping, WordPiece/Unigram unknowns), where no such bound holds."""
        if not self._bounded or not text:
            return 0
        per_token = self.max_token_bytes * _NORMALIZER_SHRINK
        return -(-len(text.encode("utf-8", errors="replace")) // per_token)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to the text in mid-sequence (b"" for unknown ids)."""
        if 0 <= token_id < self.vocab_size:
            return self._bytes[token_id]
        return b""

    def first_token_bytes(self, token_id: int) -> bytes:
        """The bytes of ``token_id`` as the first token decoded (Metaspace drops its markers)."""
        return self._first.get(token_id, self.token_bytes(token_id))

    def fallback_byte(self, token_id: int) -> int | None:
        """The byte of a ``<0xNN>`` byte-fallback token; None for every other token."""
        return self._byte_of.get(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def _special_id(self, key: str, fallback: Any) -> int | None:
        token = self.special_tokens_map.get(key)
        found = self._tok.token_to_id(token) if token else None
        if found is not None:
            return found
        ids = _as_list(fallback)
        return ids[0] if ids else None

    def _build_byte_tables(self, model_vocab: Any = None) -> None:
        """token id -> bytes in mid-sequence, and where different, as the first token.
        `model_vocab`: tokenizer.json's model.vocab; a piece -> id map (BPE, WordPiece) is what
        ``get_vocab(with_added_tokens=False)`` returns, without its ~1.5 s for 150k pieces."""
        self._bytes: list[bytes] = [b""] * self.vocab_size
        self._first: dict[int, bytes] = {}
        self._byte_of: dict[int, int] = {}
        marker = self.rules.first_token_marker
        vocab = model_vocab if isinstance(model_vocab, dict) else self._tok.get_vocab(with_added_tokens=False)
        for piece, token_id in vocab.items():
            if self.rules.byte_fallback and (m := _BYTE_TOKEN.fullmatch(piece)):
                self._byte_of[token_id] = int(m.group(1), 16)
                self._bytes[token_id] = bytes([self._byte_of[token_id]])
            elif not self.rules.supported:
                self._bytes[token_id] = self.decode([token_id]).encode("utf-8")
            else:
                self._bytes[token_id] = self._piece_bytes(piece)
                if marker is not None and marker in piece:
                    self._first[token_id] = self._piece_bytes(piece, first=True)
        for token_id, added in self._added.items():
            self._set_added_token_bytes(token_id, added.content)

    def _piece_bytes(self, piece: str, first: bool = False) -> bytes:
        if self.rules.byte_level:
            try:  # fast path: every character is one of the 256 byte stand-ins (or ASCII)
                return piece.translate(_BYTE_LEVEL_TRANSLATION).encode("latin-1")
            except UnicodeEncodeError:  # characters outside the map stay as their UTF-8
                return b"".join(
                    bytes([_UNICODE_TO_BYTE[ch]]) if ch in _UNICODE_TO_BYTE else ch.encode("utf-8")
                    for ch in piece
                )
        if first and self.rules.first_token_marker is not None:
            piece = piece.replace(self.rules.first_token_marker, "")
        for old, new in self.rules.replacements:
            piece = piece.replace(old, new)
        return piece.encode("utf-8")

    def _set_added_token_bytes(self, token_id: int, content: str) -> None:
        """Added tokens are either emitted raw or run through the decoder; ask the tokenizer."""
        expected = self.decode([token_id])
        raw = content.encode("utf-8")
        for mid, first in ((raw, raw), (self._piece_bytes(content), self._piece_bytes(content, first=True))):
            alone = first.decode("utf-8", errors="replace")
            if alone == expected or _strip_spaces(alone, self.rules.strip_output) == expected:
                self._bytes[token_id] = mid
                if first != mid:
                    self._first[token_id] = first
                return
        logger.warning("added token %d %r decodes as %r; using that", token_id, content, expected)
        self._bytes[token_id] = expected.encode("utf-8")

    # ---- chat template ------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` the way ``transformers``' apply_chat_template(tokenize=False) does."""
        template = self._pick_template(chat_template, tools)
        chat = [_normalize_message(m) for m in _plain(list(messages))]
        variables = {**self.special_tokens_map, **_plain(kwargs)}
        return _compile_template(template).render(
            messages=chat,
            tools=_plain(list(tools)) if tools is not None else None,
            documents=_plain(variables.pop("documents", None)),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def _pick_template(self, name_or_template: str | None, tools: Any) -> str:
        templates = self.chat_templates
        if name_or_template is not None:
            return templates.get(name_or_template, name_or_template)
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        if not templates:
            raise ValueError(f"the model in {self.model_dir} has no chat template")
        raise ValueError(f"no default chat template; pass one of {sorted(templates)}")


_INLINE_ENCODE_CHARS = 2048  # shorter texts: plain encode (no batch set-up for a chat turn)
_NORMALIZER_SHRINK = 4       # NFKC: a 4-byte character (U+1D400 "𝐀") can become 1 byte ("A")
_KEEPS_TEXT_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Prepend", "Replace", "Sequence"})
_KEEPS_TEXT_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split",
                                        "Sequence", "UnicodeScripts"})


def _length_is_bounded(spec: Mapping[str, Any]) -> bool:
    """Whether every byte of the text ends up in some token (so bytes bound the token count):
    a BPE model whose normalizer and pre-tokenizer never drop text."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("fuse_unk") and not model.get("byte_fallback")):
        return False  # fused unknowns: one token for any run of unknown characters
    for kind, allowed in (("normalizer", _KEEPS_TEXT_NORMALIZERS), ("pre_tokenizer", _KEEPS_TEXT_PRE_TOKENIZERS)):
        for step in _steps(spec.get(kind)):
            if step.get("type") not in allowed or step.get("behavior") == "Removed":
                return False
            pattern = (step.get("pattern") or {}).get("String")
            if step.get("type") == "Replace" and not (isinstance(pattern, str) and len(pattern) == 1
                                                      and step.get("content")):
                return False  # a regex, or a longer string, can shrink the text without bound
    return True


# "Sequence": what `_steps` leaves of an empty one
_SPLIT_LOCAL_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Replace", "Sequence"})
_SPLIT_LOCAL_PRE_TOKENIZERS = frozenset({"ByteLevel", "Digits", "Punctuation", "Split", "Whitespace",
                                         "WhitespaceSplit", "UnicodeScripts", "Sequence"})


def _cut_tokens(spec: Mapping[str, Any]) -> dict[int, str]:
    """The added tokens after which the rest of a text tokenizes on its own: id -> content.

    The tokenizer first splits a text at its added tokens, leftmost-longest: those matched on the
    raw text, then, in each piece, after normalizing it, those marked `normalized`. Each piece is
    then pre-tokenized alone, and the model never merges across pieces. So where a token T ends at
    character c of a text, ``ids(text) == ids(text[:c]) + ids(text[c:])``, provided that nothing
    after c can change the match of T:
    * T does not swallow the white space after it (rstrip) or depend on the next character
      (single_word), does not end in white space (which a following token's `lstrip` could
      claim), and no other added token contains it (a longer match through c);
    * a `normalized` T is matched after the raw-text tokens, so none of those may start inside it
      and run past c; and its piece is normalized as a whole, which only an identity normalizer
      (none, or an empty sequence) leaves the same on both sides of c.
    And provided that no step treats a piece differently by where it sits: Metaspace's
    `prepend_scheme: first` marks only the text's first piece, so those pipelines (and any step
    not listed here) get none. BPE dropout samples, so it gets none; nor does a tokenizer.json that
    truncates or pads."""
    model = spec.get("model") or {}
    if spec.get("truncation") or spec.get("padding") or model.get("dropout"):
        return {}
    normalizers = _steps(spec.get("normalizer"))
    if any(step.get("type") not in _SPLIT_LOCAL_NORMALIZERS for step in normalizers):
        return {}
    identity = all(step.get("type") == "Sequence" for step in normalizers)  # _steps: an empty one
    for step in _steps(spec.get("pre_tokenizer")):
        kind = step.get("type")
        if not (kind in _SPLIT_LOCAL_PRE_TOKENIZERS
                or (kind == "Metaspace" and step.get("prepend_scheme") in ("always", "never"))):
            return {}
    added = [a for a in spec.get("added_tokens") or [] if a.get("content") and "\0" not in a["content"]]
    everything = "\0".join(a["content"] for a in added)  # one scan a token, not one a pair
    raw_starts = {a["content"][:i] for a in added if not a.get("normalized") for i in range(1, len(a["content"]) + 1)}
    cuts = {}
    for a in added:
        text = a["content"]
        if a.get("rstrip") or a.get("single_word") or text[-1].isspace() or everything.count(text) != 1:
            continue
        if a.get("normalized") and not (identity and all(text[i:] not in raw_starts for i in range(1, len(text)))):
            continue
        cuts[int(a["id"])] = text
    return cuts


def _framing(node: Mapping[str, Any] | None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ids ``encode(text, add_special_tokens=True)`` puts before and after the text's own:
    the same for every text, since its post-processor only frames one sequence. None when the
    post-processor is one this does not model (then only a whole encode gives those ids)."""
    pre: list[int] = []
    post: list[int] = []
    framed = False
    for step in _processors(node):
        kind = step.get("type")
        if kind == "ByteLevel":
            continue  # offsets only
        if framed:
            return None  # a second frame around the first: not modelled
        framed = True
        if kind in ("BertProcessing", "RobertaProcessing"):
            pre, post = [int(step["cls"][1])], [int(step["sep"][1])]
        elif kind == "TemplateProcessing":
            specials = step.get("special_tokens") or {}
            side = pre
            for piece in step.get("single") or []:
                if "Sequence" in piece:
                    if side is post:
                        return None  # the text twice
                    side = post
                elif "SpecialToken" in piece and piece["SpecialToken"]["id"] in specials:
                    side.extend(int(i) for i in specials[piece["SpecialToken"]["id"]]["ids"])
                else:
                    return None
            if side is pre:
                return None  # no place for the text
        else:
            return None
    return tuple(pre), tuple(post)


def _processors(node: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [step for child in node.get("processors") or [] for step in _processors(child)]
    return [node]


def _steps(node: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    if not node:
        return []
    children = node.get("normalizers") or node.get("pretokenizers")
    if node.get("type") == "Sequence" and children is not None:
        return [step for child in children for step in _steps(child)]
    return [node]


def _strip_spaces(text: str, limit: int) -> str:
    """What a Strip(" ", start=limit) decoder leaves of ``text``."""
    n = 0
    while n < limit and n < len(text) and text[n] == " ":
        n += 1
    return text[n:]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _load_chat_templates(model_dir: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named templates; files (chat_template.jinja, additional_chat_templates/) win over config."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        templates.update({t["name"]: t["template"] for t in raw})
    from_files: dict[str, str] = {}
    if (model_dir / "chat_template.jinja").is_file():
        from_files["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            from_files[path.stem] = path.read_text(encoding="utf-8")
    return from_files or templates


def _plain(value: Any) -> Any:
    """JSON-like copies of what the template may see (dicts, lists, pydantic models, dataclasses)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    for base in (bool, str, int, float):
        if isinstance(value, base):
            return base(value)
    return f"<{type(value).__name__}>"


def _normalize_message(message: Any) -> dict[str, Any]:
    """Drop None fields (templates handle missing keys, not None) and alias reasoning names.
    `content` stays, None included: DeepSeek V3/R1/V3.1 templates test `message['content'] is
    none` to tell a tool-call turn, and fail on a missing key."""
    if not isinstance(message, dict):
        raise TypeError(f"chat messages must be dicts, got {message!r}")
    out = {k: v for k, v in message.items() if v is not None or k == "content"}
    reasoning = next((out[k] for k in _REASONING_KEYS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training; render it as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """jinja's namespace() without underscore attributes (no way to reach Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:
    # Unlike jinja's own tojson this does not HTML-escape, as chat templates expect.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        namespace=_SafeNamespace,
        dict=_make_dict,
    )
    return env.from_string(source)


class IncrementalDetokenizer:
    """Streams text from token ids; the pieces concatenate to ``decode(all_ids)``.

    Works on token bytes: an incomplete UTF-8 tail is held until its character completes, and a
    run of ``<0xNN>`` byte-fallback tokens is held until it ends, because the tokenizer decodes
    such a run as a whole (one U+FFFD per byte if the run is not valid UTF-8). Leading-space
    stripping (sentencepiece) is applied once, at the start of the stream. Call ``flush`` at the
    end of the stream; it emits whatever is held.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._run = bytearray()
        self._seen_token = False
        self._strip_left = tokenizer.rules.strip_output

    def push(self, ids: Iterable[int] | int) -> str:
        """Add tokens; return the text they completed (possibly empty)."""
        tok = self.tokenizer
        parts: list[str] = []
        for token_id in (ids,) if isinstance(ids, int) else ids:
            if self.skip_special_tokens and tok.is_special(token_id):
                continue
            if self._seen_token:
                data = tok.token_bytes(token_id)
            else:
                self._seen_token = True
                data = tok.first_token_bytes(token_id)
            byte = tok.fallback_byte(token_id)
            if byte is not None:
                self._run.append(byte)
                continue
            if self._run:
                parts.append(self._close_run())
            parts.append(self._utf8.decode(data))
        return self._strip("".join(parts))

    def flush(self) -> str:
        """End of stream: emit held bytes (an incomplete character becomes U+FFFD)."""
        text = self._close_run() if self._run else ""
        return self._strip(text + self._utf8.decode(b"", final=True))

    def _close_run(self) -> str:
        run, self._run = bytes(self._run), bytearray()
        try:
            return self._utf8.decode(b"", final=True) + run.decode("utf-8")
        except UnicodeDecodeError:
            return "\ufffd" * len(run)

    def _strip(self, text: str) -> str:
        if not self._strip_left or not text:
            return text
        stripped = _strip_spaces(text, self._strip_left)
        removed = len(text) - len(stripped)
        # Once a non-space character went out, nothing further is stripped.
        self._strip_left = 0 if stripped else self._strip_left - removed
        return stripped
