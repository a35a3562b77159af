"""vLLM's ``bad_words`` as token sequences for the executor's mask (executor_svc/token_masks.py).

Each word is tokenized as written (left-stripped) and with a leading space, so that it is
banned at the start of the text and after a space; the spaced form is kept only when it is
a different word token of the same length (vLLM's rule). The scheduler holds the tokenizer;
the executor sees only ids.
"""

from __future__ import annotations

from typing import Any

from scheduler_svc.frontend.refusals import InvalidArgument


def sequences(tokenizer: Any, words: list[str], vocab_size: int) -> tuple[tuple[int, ...], ...]:
    out: list[tuple[int, ...]] = []
    for i, word in enumerate(words):
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not bare:
            raise InvalidArgument(f"sampling.bad_words[{i}]", "tokenizes to no tokens")
        out.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
        if any(t >= vocab_size for t in out[-1] + bare):
            raise InvalidArgument(
                f"sampling.bad_words[{i}]", f"has token ids at or above the vocabulary size {vocab_size}"
            )
    return tuple(out)
