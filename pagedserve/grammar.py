"""Structured-output grammars, shared by the scheduler (which compiles a spec once at
submission to refuse a bad one) and the executor (which masks logits with it).

A spec is ``(kind, text)``: ``json_schema``, ``regex``, ``ebnf`` or ``json_object``
(``text`` empty); a list of choices becomes an EBNF alternation here, so that the
executor knows four kinds only. ``Compiler`` wraps xgrammar's ``GrammarCompiler``:
its cache holds each distinct spec's compiled grammar (token-mask tables included),
bounded in bytes. xgrammar is imported lazily: a process that never sees a
structured request never loads it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

KINDS = ("json_schema", "regex", "ebnf", "json_object")
MAX_GRAMMAR_BYTES = 64 << 10  # UTF-8 bytes of a spec (the scheduler's --max-grammar-bytes)
CACHE_BYTES = 256 << 20  # compiled grammars kept per process (xgrammar's cache_limit_bytes)

Spec = tuple[str, str]  # (kind, text)


class GrammarError(ValueError):
    """A spec that does not compile; the message says why (xgrammar's words)."""


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are
    xgrammar's EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its ``[time] file:line:`` prefix."""
    text = str(exc).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
        head, sep, rest = text.partition(": ")
        if sep and (".cc:" in head or ".h:" in head):
            text = rest
    return text.splitlines()[0] if text else type(exc).__name__


class Compiler:
    """Compiles specs for one tokenizer; thread-safe, cached by spec.

    ``stop_token_ids``: the tokens the matcher accepts once the grammar is complete
    (the executor's EOS ids, which end a request with finish_reason "stop").
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int] | None = None,
        cache_bytes: int = CACHE_BYTES,
        max_threads: int = 1,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) if stop_token_ids else None
        )
        self.stop_token_ids = list(self.info.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(
            self.info, max_threads=max_threads, cache_enabled=True, cache_limit_bytes=cache_bytes
        )

    def compile(self, spec: Spec) -> Any:
        """The compiled grammar of ``spec``; raises GrammarError."""
        kind, text = spec
        c = self._compiler
        try:
            if kind == "json_schema":
                json.loads(text)  # xgrammar's own message for bad JSON quotes the whole document
                # Compact JSON: a small model left free to add whitespace can loop on it forever.
                return c.compile_json_schema(text, any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "ebnf":
                return c.compile_grammar(text)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"not valid JSON: {exc}") from exc
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(_reason(exc)) from exc
        raise GrammarError(f"unknown grammar kind {kind!r} (one of {', '.join(KINDS)})")

    def matcher(self, spec: Spec) -> Any:
        """A fresh matcher for ``spec`` at the start of the output."""
        return self._xgr.GrammarMatcher(self.compile(spec))
