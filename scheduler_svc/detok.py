"""Incremental detokenization with stop strings.

Decoding a growing list of ids token by token can split a multi-byte character
or a word-piece; the offsets trick (as in TGI and vLLM) decodes a small window
and only emits text once it no longer ends in a replacement character. When
stop strings are set, the last ``max(len(stop)) - 1`` characters are held back
so that a stop string split across steps is never streamed before it is seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Detokenizer:
    tokenizer: Any
    stop: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far (cut at a stop string once one is found)
    emitted: int = 0  # characters of ``text`` already returned
    stopped: bool = False
    _prefix: int = 0
    _read: int = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, tokens: list[int]) -> list[int]:
        """Take newly generated tokens; returns those accepted (none after a stop string)."""
        accepted = []
        for t in tokens:
            if self.stopped:
                break
            self.ids.append(t)
            accepted.append(t)
            prefix = self._decode(self.ids[self._prefix : self._read])
            window = self._decode(self.ids[self._prefix :])
            if len(window) > len(prefix) and not window.endswith("\ufffd"):
                self.text += window[len(prefix) :]
                self._prefix, self._read = self._read, len(self.ids)
                self._check_stop(len(window) - len(prefix))
        return accepted

    def _check_stop(self, added: int) -> None:
        if not self.stop:
            return
        longest = max(len(s) for s in self.stop)
        start = max(0, len(self.text) - added - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def take(self, final: bool) -> str:
        """Text not yet returned; holds back a possible stop-string prefix unless ``final``."""
        if final and not self.stopped:
            # The whole decode is the ground truth: flush what the window kept back.
            full = self._decode(self.ids)
            if full.startswith(self.text):
                self.text = full
        end = len(self.text)
        if not final and not self.stopped and self.stop:
            end = max(self.emitted, end - (max(len(s) for s in self.stop) - 1))
        chunk = self.text[self.emitted : end]
        self.emitted = end
        return chunk
