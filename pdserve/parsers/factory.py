"""One parser per request, chosen by the model profile resolved at start-up."""
from __future__ import annotations

from pdserve.parsers.base import StreamParser
from pdserve.parsers.deepseek_v3 import DeepSeekV3Parser
from pdserve.parsers.dsml import DsmlParser
from pdserve.parsers.glm import GlmParser
from pdserve.parsers.hermes import HermesParser
from pdserve.parsers.options import ParserOptions
from pdserve.parsers.plain import PlainParser
from pdserve.parsers.profiles import Format, Profile

_PARSERS: dict[Format, type[StreamParser]] = {
    Format.PLAIN: PlainParser,
    Format.DSML: DsmlParser,
    Format.GLM: GlmParser,
    Format.HERMES: HermesParser,
    Format.DSV3: DeepSeekV3Parser,
}


def make_parser(profile: Profile, options: ParserOptions | None = None) -> StreamParser:
    return _PARSERS[profile.format](profile, options or ParserOptions())
