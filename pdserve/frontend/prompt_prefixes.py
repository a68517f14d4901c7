"""Token ids of recent prompts, so that a conversation's next turn tokenizes only its new text.

An agent resends its whole conversation every turn, and the router renders and tokenizes all of
it again: ≈ 1.6 µs a token here, 38 ms for a 22,000-token conversation, paid before the worker
sees the request, on every turn, while the worker's prefix cache makes the turn itself cheap.
The rendered text of turn k+1 starts with the text of turn k up to its last special token
(chat templates open the assistant's answer after one), and a tokenizer splits a text at its
special tokens before anything else, so the ids up to there are turn k's
(``Tokenizer.cut_tokens`` says for which tokens and pipelines this holds exactly).

``PromptPrefixes.encode(text)`` therefore looks for the longest remembered prefix of `text` that
ends right after such a token, tokenizes only the rest, and remembers the new text up to its own
last such token. The entries are keyed by the text itself (compared, not hashed into a guess),
kept least recently used first, and bounded by the tokens they hold. A request's `cache_salt`
keeps its entries apart, as it does its KV blocks: how fast a prompt tokenizes must not tell
one tenant what another sent.
"""
from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable

from pdserve.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 2_000_000  # ≈ 8 MB of ids and about as much text: ~90 conversations of 22k tokens
Key = tuple[str | None, str]   # (cache_salt, prefix text)


class PromptPrefixes:
    """Remembered prompt prefixes and their ids, for one tokenizer. Safe to call from several
    threads (the router tokenizes long prompts off its event loop)."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        cuts = tokenizer.cut_tokens
        self._cut_ids = frozenset(cuts)
        # where a remembered prefix may end: after any character that ends a cut token (a
        # superset of the cut tokens' ends, found far faster than 1,000 alternatives would be)
        self._cut_end = re.compile("[" + "".join(sorted({re.escape(t[-1]) for t in cuts.values()})) + "]"
                                   ) if cuts else None
        self._entries: OrderedDict[Key, array] = OrderedDict()  # (salt, prefix text) -> its ids
        self._by_end: dict[int, list[Key]] = {}                 # prefix length -> keys of it
        self._held = 0
        self._lock = threading.Lock()
        self.on_reuse: Callable[[int], None] | None = None  # told how many ids an encode took from an entry

    @property
    def enabled(self) -> bool:
        return self._cut_end is not None and self.max_tokens > 0

    def encode(self, text: str, salt: str | None = None) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=False)``, tokenizing only what follows the
        longest prefix remembered under the same `salt`."""
        if not self.enabled:
            return self.tokenizer.encode(text, add_special_tokens=False)
        start, kept = self._longest(text, salt)
        head = kept.tolist()
        if head and self.on_reuse is not None:
            self.on_reuse(len(head))
        ids, ends = self.tokenizer.encode_with_ends(text[start:])
        self._remember(text, salt, start, kept, ids, ends)
        return head + ids

    def clear(self) -> None:
        """Forget every entry (`POST /reset_prefix_cache`: a cold start, tokenization included)."""
        with self._lock:
            self._entries.clear()
            self._by_end.clear()
            self._held = 0

    def _longest(self, text: str, salt: str | None) -> tuple[int, array]:
        """The end of the longest remembered prefix of `text` and a copy of its ids; (0, empty)
        if none."""
        assert self._cut_end is not None
        ends = [m.end() for m in self._cut_end.finditer(text)]
        with self._lock:
            for end in reversed(ends):
                for key in self._by_end.get(end, ()):
                    if key[0] == salt and text.startswith(key[1]):
                        self._entries.move_to_end(key)
                        return end, self._entries[key][:]
        return 0, array("i")

    def _remember(self, text: str, salt: str | None, start: int, kept: array, ids: list[int],
                  ends: list[int]) -> None:
        """Keep `text` up to the last cut token that the new part tokenized (if any)."""
        last = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] in self._cut_ids), None)
        if last is None:
            return
        end = start + ends[last]
        token = self.tokenizer.cut_tokens[ids[last]]
        if not text.startswith(token, end - len(token)):
            return  # offsets that do not point at the token's text: keep nothing rather than guess
        size = len(kept) + last + 1
        if size > self.max_tokens:
            return
        key = (salt, text[:end])
        kept.extend(ids[:last + 1])  # the caller's copy: it becomes the new entry
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            if start:  # the prefix this one extends: a conversation keeps one entry, its latest
                self._drop((salt, text[:start]))
            self._entries[key] = kept
            self._by_end.setdefault(end, []).append(key)
            self._held += size
            while self._held > self.max_tokens:
                self._drop(next(iter(self._entries)))

    def _drop(self, key: Key) -> None:
        ids = self._entries.pop(key, None)
        if ids is None:
            return  # gone already (another thread's eviction)
        end = len(key[1])
        same = self._by_end[end]
        same.remove(key)
        if not same:
            del self._by_end[end]
        self._held -= len(ids)
