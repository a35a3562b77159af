"""Incremental detokenization with stop strings.

Decoding a growing list of ids token by token can split a multi-byte character
or a word-piece. The tokenizer's own incremental decoder (``tokenizers``'
``DecodeStream``, in Rust: about 3 us a token against ~16 us for the window of
two Python-side decodes TGI and vLLM used before it) emits text only once it
no longer ends inside a character. When stop strings are set, the last
``max(len(stop)) - 1`` characters are held back so that a stop string split
across steps is never streamed before it is seen. The final message's text is
checked against one whole decode (``take(final=True)``). With ``include_stop`` (vLLM's
include_stop_str_in_output) the text ends after the stop string instead of before it,
and nothing is held back: what could be a stop string's start is text to send either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers.decoders import DecodeStream


@dataclass(slots=True)
class Detokenizer:
    tokenizer: Any  # a fast (Rust-backed) transformers tokenizer
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False  # the matched stop string stays at the end of the text
    ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far (cut at a stop string once one is found)
    emitted: int = 0  # characters of ``text`` already returned
    stopped: bool = False
    _stream: DecodeStream = field(default_factory=lambda: DecodeStream(skip_special_tokens=True))

    def add(self, tokens: list[int]) -> list[int]:
        """Take newly generated tokens; returns those accepted (none after a stop string)."""
        accepted = []
        backend = self.tokenizer.backend_tokenizer
        for t in tokens:
            if self.stopped:
                break
            self.ids.append(t)
            accepted.append(t)
            piece = self._stream.step(backend, t)
            if piece:
                self.text += piece
                self._check_stop(len(piece))
        return accepted

    def _check_stop(self, added: int) -> None:
        if not self.stop:
            return
        longest = max(len(s) for s in self.stop)
        start = max(0, len(self.text) - added - longest + 1)
        hits = [(i, len(s)) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            at, length = min(hits)
            self.text = self.text[: at + length if self.include_stop else at]
            self.stopped = True

    def take(self, final: bool) -> str:
        """Text not yet returned; holds back a possible stop-string prefix unless ``final``."""
        if final and not self.stopped:
            # The whole decode is the ground truth: flush what the stream kept back (an unfinished character).
            full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if full.startswith(self.text):
                self.text = full
        end = len(self.text)
        if not final and not self.stopped and self.stop and not self.include_stop:
            end = max(self.emitted, end - (max(len(s) for s in self.stop) - 1))
        chunk = self.text[self.emitted : end]
        self.emitted = end
        return chunk
