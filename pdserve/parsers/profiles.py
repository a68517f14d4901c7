"""Model profiles: which marker ids a model's output grammar uses, resolved once at start-up.

A profile is resolved from the checkpoint's own tokenizer, never from hard-coded ids: a marker
that the grammar needs as one token but that the tokenizer splits would make the parser blind
to it, so resolution refuses to start instead (``ProfileError``).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from pdserve.parsers.vocab import Vocab

log = logging.getLogger(__name__)

DSML = "\uff5cDSML\uff5c"
THINK_START, THINK_END = "<think>", "</think>"
# End-of-output markers by family. GLM stops on the next turn's role tokens as well.
_EOS_COMMON = ("<\uff5cend\u2581of\u2581sentence\uff5c>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>",
               "<|end_of_text|>", "</s>")
_EOS_GLM = ("<|user|>", "<|observation|>")
_GLM_MARKERS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
_HERMES_MARKERS = ("<tool_call>", "</tool_call>")
# DeepSeek V3 / R1 / V3.1: calls begin, calls end, call begin, call end, separator.
_DSV3_MARKERS = ("<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>",
                 "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>",
                 "<\uff5ctool\u2581sep\uff5c>")
# Only V3.1 (of the V3-marker tokenizers without DSML) has the search markers as single tokens.
_V31_ONLY = "<\uff5csearch\u2581begin\uff5c>"
# Override names (the future --tool-call-parser flag) -> family; peers' names are accepted too.
PARSER_NAMES: dict[str, str] = {
    "deepseek_v3": "deepseek_v3", "deepseek_r1": "deepseek_v3",
    "deepseek_v31": "deepseek_v31",
    "deepseek_v32": "deepseek_v32", "deepseek_v4": "deepseek_v4",
    "glm": "glm", "glm45": "glm", "glm47": "glm",
    "hermes": "hermes", "qwen": "hermes", "qwen25": "hermes", "qwen3": "hermes",
    "plain": "plain", "none": "plain",
}
# Control tokens shaped like <｜…｜> or <|…|> never become text, even where not marked special.
_CONTROL = re.compile(rb"<(\xef\xbd\x9c|\|)[^\s]*(\xef\xbd\x9c|\|)>\Z")
_KNOWN_DSML_IDS = {128793: "function_calls", 128825: "tool_calls"}


class ProfileError(ValueError):
    """The tokenizer cannot carry the model's output grammar; the server must not start."""


class Format(Enum):
    PLAIN = "plain"    # reasoning markers at most; everything else is content
    DSML = "dsml"      # DeepSeek V3.2 / V4
    GLM = "glm"        # GLM-4.5 … GLM-5 <tool_call>name<arg_key>…
    HERMES = "hermes"  # Qwen and other <tool_call>{json}</tool_call> models
    DSV3 = "dsv3"      # DeepSeek V3 / R1 / V3.1: <｜tool▁call▁begin｜>…<｜tool▁sep｜>…


@dataclass(frozen=True)
class ThinkIds:
    start: int
    end: int


@dataclass(frozen=True)
class DsmlIds:
    dsml: int
    block_name: str  # function_calls (V3.2) or tool_calls (V4); strict mode accepts only this one


@dataclass(frozen=True)
class GlmIds:
    call_open: int
    call_close: int
    key_open: int
    key_close: int
    value_open: int
    value_close: int


@dataclass(frozen=True)
class HermesIds:
    call_open: int
    call_close: int


@dataclass(frozen=True)
class DsV3Ids:
    calls_begin: int
    calls_end: int
    call_begin: int
    call_end: int
    sep: int
    fenced: bool  # V3/R1: `function<sep>NAME\n```json\nARGS\n```` ; V3.1: `NAME<sep>ARGS`


@dataclass(frozen=True)
class Profile:
    name: str
    format: Format
    vocab: Vocab = field(repr=False, compare=False)
    eos_ids: frozenset[int] = frozenset()
    drop_ids: frozenset[int] = frozenset()  # control ids that are never shown and mean nothing here
    think: ThinkIds | None = None
    dsml: DsmlIds | None = None
    glm: GlmIds | None = None
    hermes: HermesIds | None = None
    dsv3: DsV3Ids | None = None

    def marker_ids(self) -> frozenset[int]:
        ids: list[int] = []
        for part in (self.think, self.dsml, self.glm, self.hermes, self.dsv3):
            if part is not None:
                ids.extend(v for v in vars(part).values() if isinstance(v, int) and not isinstance(v, bool))
        return frozenset(ids)


def single_token(vocab: Vocab, text: str) -> int | None:
    """The id of `text` if the vocabulary holds it as exactly one token, else None."""
    token_id = vocab.token_to_id(text)
    if token_id is None or vocab.token_bytes(token_id) != text.encode("utf-8"):
        return None
    return token_id


def resolve_profile(vocab: Vocab, model_type_hint: str | None = None, chat_template: str | None = None,
                    override: str | None = None) -> Profile:
    """Pick the output grammar for a tokenizer.

    `override` (a name from PARSER_NAMES, the `--tool-call-parser` flag) forces a family; an
    unknown name is a ProfileError. Otherwise the hint (config.json `model_type` or a family name
    such as "deepseek_v32", "glm", "qwen", "plain") forces a family, else the tokenizer decides;
    the chat template (when given) tells DeepSeek V3/R1 calls from V3.1 calls, which share their
    marker tokens. A forced family's markers are mandatory."""
    if override is not None:
        family = PARSER_NAMES.get(override.strip().lower().replace("-", "_").replace(".", ""))
        if family is None:
            raise ProfileError(f"unknown tool-call parser {override!r}; one of {', '.join(sorted(PARSER_NAMES))}")
    else:
        family = _family(model_type_hint) or _detect(vocab)
        if family in ("deepseek_v3", "deepseek_v31") and chat_template:
            family = _dsv3_family_from_template(chat_template) or family
    think = _think(vocab, required=family in ("deepseek_v32", "deepseek_v4"))
    if family in ("deepseek_v32", "deepseek_v4"):
        dsml = _require(vocab, family, DSML)
        profile = _build(vocab, family, Format.DSML, think, dsml=DsmlIds(dsml, _default_block(family)))
    elif family == "glm":
        ids = [_require(vocab, family, m) for m in _GLM_MARKERS]
        profile = _build(vocab, family, Format.GLM, think, glm=GlmIds(*ids), extra_eos=_EOS_GLM)
    elif family == "hermes":
        ids = [_require(vocab, family, m) for m in _HERMES_MARKERS]
        profile = _build(vocab, family, Format.HERMES, think, hermes=HermesIds(*ids))
    elif family in ("deepseek_v3", "deepseek_v31"):
        ids = [_require(vocab, family, m) for m in _DSV3_MARKERS]
        profile = _build(vocab, family, Format.DSV3, think,
                         dsv3=DsV3Ids(*ids, fenced=family == "deepseek_v3"))
    else:
        profile = _build(vocab, "plain", Format.PLAIN, think)
    log.info("output parser profile %s (think=%s, eos=%s)", profile.name, profile.think,
             sorted(profile.eos_ids))
    return profile


def prompt_opens_reasoning(profile: Profile, prompt_ids: Sequence[int]) -> bool:
    """True when the rendered prompt ends inside a reasoning section (last non-blank token is
    the think-start marker), so the output starts as reasoning. Derived from ids, not flags."""
    if profile.think is None:
        return False
    for token_id in reversed(prompt_ids):
        if token_id == profile.think.start:
            return True
        if profile.vocab.token_bytes(token_id).strip() != b"":
            return False
    return False


def _default_block(family: str) -> str:
    return "tool_calls" if family == "deepseek_v4" else "function_calls"


def _family(hint: str | None) -> str | None:
    if not hint:
        return None
    key = re.sub(r"[^a-z0-9]", "", hint.lower())
    if "glm" in key:
        return "glm"
    if key.startswith("deepseekv4"):
        return "deepseek_v4"
    if key.startswith("deepseekv32") or key.startswith("deepseekv3.2"):
        return "deepseek_v32"
    if "qwen" in key or "hermes" in key:
        return "hermes"
    if key in ("plain", "none"):
        return "plain"
    return None


def _detect(vocab: Vocab) -> str:
    dsml = single_token(vocab, DSML)
    if dsml is not None:
        if _KNOWN_DSML_IDS.get(dsml) == "tool_calls" or single_token(vocab, "<\uff5clatest_reminder\uff5c>"):
            return "deepseek_v4"
        return "deepseek_v32"
    if all(single_token(vocab, m) is not None for m in _DSV3_MARKERS):
        return "deepseek_v31" if single_token(vocab, _V31_ONLY) is not None else "deepseek_v3"
    if all(single_token(vocab, m) is not None for m in _GLM_MARKERS):
        return "glm"
    if all(single_token(vocab, m) is not None for m in _HERMES_MARKERS):
        return "hermes"
    return "plain"


def _dsv3_family_from_template(template: str) -> str | None:
    """V3/R1 templates write `tool['type'] + '<｜tool▁sep｜>'`, V3.1 writes the name there."""
    sep = "<\uff5ctool\u2581sep\uff5c>"
    if re.search(r"\[['\"]type['\"]\]\s*\+\s*['\"]" + sep, template):
        return "deepseek_v3"
    if re.search(r"\[['\"]name['\"]\]\s*\+\s*['\"]" + sep, template):
        return "deepseek_v31"
    return None


def _require(vocab: Vocab, family: str, marker: str) -> int:
    token_id = single_token(vocab, marker)
    if token_id is None:
        raise ProfileError(f"{family}: marker {marker!r} is not a single token in this tokenizer; "
                           "its output grammar cannot be parsed at the id level, refusing to start")
    return token_id


def _think(vocab: Vocab, required: bool) -> ThinkIds | None:
    start, end = single_token(vocab, THINK_START), single_token(vocab, THINK_END)
    if start is None or end is None:
        if required:
            _require(vocab, "reasoning", THINK_START if start is None else THINK_END)
        return None
    return ThinkIds(start, end)


def _build(vocab: Vocab, name: str, fmt: Format, think: ThinkIds | None,
           extra_eos: Iterable[str] = (), **parts: object) -> Profile:
    control = control_ids(vocab)  # an end marker must be a control token: Qwen has `</s>` as text
    eos = frozenset(i for m in (*_EOS_COMMON, *extra_eos) if (i := single_token(vocab, m)) in control)
    profile = Profile(name, fmt, vocab, eos, frozenset(), think, **parts)  # type: ignore[arg-type]
    drop = control - profile.marker_ids() - eos
    return Profile(name, fmt, vocab, eos, drop, think, **parts)  # type: ignore[arg-type]


def control_ids(vocab: Vocab) -> frozenset[int]:
    """Special ids plus control-shaped added tokens (`<｜User｜>` is not marked special in V3.2)."""
    special = frozenset(getattr(vocab, "special_ids", ()) or ())
    candidates: Iterable[int] = getattr(vocab, "added_ids", None) or range(vocab.vocab_size)
    shaped = frozenset(i for i in candidates if _CONTROL.match(vocab.token_bytes(i)))
    return special | shaped
