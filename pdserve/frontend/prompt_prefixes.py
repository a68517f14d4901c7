"""Token ids of recent prompts, so that a conversation's next turn tokenizes only its new text.

An agent resends its whole conversation every turn, and the router renders and tokenizes all of
it again: ≈ 1.6 µs a token here, 38 ms for a 22,000-token conversation, paid before the worker
sees the request, on every turn, while the worker's prefix cache makes the turn itself cheap.
The rendered text of turn k+1 starts with the text of turn k up to its last special token
(chat templates open the assistant's answer after one), and a tokenizer splits a text at its
special tokens before anything else, so the ids up to there are turn k's
(``Tokenizer.cut_tokens`` says for which tokens and pipelines this holds exactly).

``PromptPrefixes.encode(text)`` therefore looks for the longest remembered text that `text`
starts with up to a point right after such a token, tokenizes only the rest, and remembers the
new text up to its own last such token, with the ids at each such point in it. Any of those
points will do, not only the last: a template may rewrite the end of the last prompt (DeepSeek
V4 opens a thinking answer with `<think>`, and the next turn shows that answer without it). The
entries are compared by their text, not by a hash, kept least recently used first, and bounded
by the tokens they hold. A conversation keeps one, its newest: an entry whose text the next turn
takes up to its last few ids is replaced, while one whose prompt another request shares only in
part (a system prompt) stays for its own conversation. A request's `cache_salt` keeps
its entries apart, as it does its KV blocks: how fast a prompt tokenizes must not tell one
tenant what another sent.
"""
from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 2_000_000  # ≈ 8 MB of ids and about as much text: ~90 conversations of 22k tokens
REWRITTEN_TAIL = 8  # ids a template may rewrite at the end of the last prompt (Qwen3: "assistant\n<think>\n\n</think>\n\n")
Key = tuple[str | None, str]   # (cache_salt, text)


@dataclass
class _Entry:
    ids: array             # the ids of the key's text
    cuts: dict[int, int]   # every point right after a cut token in the text -> the ids before it


class PromptPrefixes:
    """Remembered prompt texts and their ids, for one tokenizer. Safe to call from several
    threads (the router tokenizes long prompts off its event loop)."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        cuts = tokenizer.cut_tokens
        self._cut_ids = frozenset(cuts)
        # where a remembered point may be: after any character that ends a cut token (a
        # superset of the cut tokens' ends, found far faster than 1,000 alternatives would be)
        self._cut_end = re.compile("[" + "".join(sorted({re.escape(t[-1]) for t in cuts.values()})) + "]"
                                   ) if cuts else None
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        self._by_end: dict[int, dict[Key, None]] = {}  # a point -> the entries with a cut there
        self._held = 0
        self._lock = threading.Lock()
        self.on_reuse: Callable[[int], None] | None = None  # told how many ids an encode took from an entry

    @property
    def enabled(self) -> bool:
        return self._cut_end is not None and self.max_tokens > 0

    def encode(self, text: str, salt: str | None = None, add_special_tokens: bool = False) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens)``, tokenizing only what follows the
        longest prefix remembered under the same `salt`. The special tokens a text completion's
        prompt gets (a BOS) frame the text's own ids (``Tokenizer.framing``)."""
        framing = self.tokenizer.framing if add_special_tokens else ((), ())
        if framing is None or not self.enabled:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if framing != ((), ()):
            return [*framing[0], *self.encode(text, salt), *framing[1]]
        start, hit, kept, cuts = self._longest(text, salt)
        head = kept.tolist()
        if head and self.on_reuse is not None:
            self.on_reuse(len(head))
        ids, ends = self.tokenizer.encode_with_ends(text[start:])
        self._remember(text, salt, start, hit, kept, cuts, ids, ends)
        return head + ids

    def clear(self) -> None:
        """Forget every entry (`POST /reset_prefix_cache`: a cold start, tokenization included)."""
        with self._lock:
            self._entries.clear()
            self._by_end.clear()
            self._held = 0

    def _longest(self, text: str, salt: str | None) -> tuple[int, Key | None, array, dict[int, int]]:
        """The longest remembered prefix of `text` that ends at a cut: where it ends, the entry
        it came from, a copy of its ids and its cuts up to there."""
        assert self._cut_end is not None
        ends = [m.end() for m in self._cut_end.finditer(text)]
        with self._lock:
            for end in reversed(ends):
                for key in self._by_end.get(end, ()):
                    if key[0] == salt and text.startswith(key[1] if len(key[1]) == end else key[1][:end]):
                        entry = self._entries[key]
                        self._entries.move_to_end(key)
                        return end, key, entry.ids[:entry.cuts[end]], {e: n for e, n in entry.cuts.items() if e <= end}
        return 0, None, array("i"), {}

    def _remember(self, text: str, salt: str | None, start: int, hit: Key | None, kept: array,
                  cuts: dict[int, int], ids: list[int], ends: list[int]) -> None:
        """Keep `text` up to its last cut, with the ids at each of its cuts, in place of the
        entry `hit` when it adds at most a rewritten tail to what `text` took of it."""
        base = len(kept)
        for i, token_id in enumerate(ids):
            if token_id in self._cut_ids:
                end, token = start + ends[i], self.tokenizer.cut_tokens[token_id]
                if text.startswith(token, end - len(token)):  # else offsets we do not trust: no cut
                    cuts[end] = base + i + 1
        if not cuts:
            return
        end = max(cuts)
        size = cuts[end]
        if size > self.max_tokens:
            return
        kept.extend(ids[:size - base])  # the caller's copy of the prefix's ids: the new entry's
        key = (salt, text[:end])
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            old = self._entries.get(hit) if hit is not None else None
            if old is not None and len(old.ids) - old.cuts[start] <= REWRITTEN_TAIL:
                self._drop(hit)
            self._entries[key] = _Entry(kept, cuts)
            for e in cuts:
                self._by_end.setdefault(e, {})[key] = None
            self._held += size
            while self._held > self.max_tokens:
                self._drop(next(iter(self._entries)))

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key)
        for e in entry.cuts:
            same = self._by_end[e]
            del same[key]
            if not same:
                del self._by_end[e]
        self._held -= len(entry.ids)
