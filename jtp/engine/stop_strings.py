"""Stop strings matched in time proportional to the new text, whatever their number.

An Aho-Corasick automaton over a request's stop strings is fed each new character once, so a
token costs O(its text) on the step thread instead of one `str.find` per stop string (100k stop
strings made every token of every request in the batch wait). The automaton's state also says
how much of the text's tail could still begin a match: only that much is held back from the
stream.

Semantics: the output ends at the first character that completes any stop string; the cut is
at the start of the longest stop string ending there (the earliest start). Text fed with
`may_stop` False (a request short of its min_tokens) advances the automaton but ends nothing.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        # Trie nodes: children by character, failure link, depth, longest stop string ending here.
        self._next: list[dict[str, int]] = [{}]
        self._fail: list[int] = [0]
        self._depth: list[int] = [0]
        self._match: list[int] = [0]  # length of the longest stop string that is a suffix here; 0: none
        for stop in stops:
            if stop:
                self._insert(stop)
        self._link()
        self._state = 0
        self._seen = 0  # characters fed so far

    def _insert(self, stop: str) -> None:
        node = 0
        for ch in stop:
            nxt = self._next[node].get(ch)
            if nxt is None:
                nxt = len(self._next)
                self._next[node][ch] = nxt
                self._next.append({})
                self._fail.append(0)
                self._depth.append(self._depth[node] + 1)
                self._match.append(0)
            node = nxt
        self._match[node] = len(stop)

    def _link(self) -> None:
        """Failure links breadth-first; a node's match also covers the matches of its failure chain
        (those are shorter, so the longest is the node's own if it has one)."""
        queue = list(self._next[0].values())
        for node in queue:  # the root's children fail to the root
            self._fail[node] = 0
        i = 0
        while i < len(queue):
            node = queue[i]
            i += 1
            for ch, child in self._next[node].items():
                f = self._fail[node]
                while f and ch not in self._next[f]:
                    f = self._fail[f]
                target = self._next[f].get(ch, 0)
                self._fail[child] = target if target != child else 0
                if not self._match[child]:
                    self._match[child] = self._match[self._fail[child]]
                queue.append(child)

    @property
    def active(self) -> bool:
        return len(self._next) > 1

    @property
    def pending(self) -> int:
        """Characters at the end of the text fed so far that could still begin a stop string."""
        return self._depth[self._state]

    def feed(self, text: str, may_stop: bool = True) -> int | None:
        """Feed new text; the index (into everything fed) where the output must end, or None (always
        None unless `may_stop`)."""
        nxt, fail, match = self._next, self._fail, self._match
        state = self._state
        for i, ch in enumerate(text):
            while state and ch not in nxt[state]:
                state = fail[state]
            state = nxt[state].get(ch, 0)
            if match[state] and may_stop:
                end = self._seen + i + 1
                self._state, self._seen = state, end
                return end - match[state]
        self._state = state
        self._seen += len(text)
        return None
