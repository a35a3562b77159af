"""The speculative-decoding arm's workload: chat requests whose answers quote their prompts.

Each task hands the model a passage or a code snippet and asks for it back changed: rewrite or summarise
a passage, edit a function. The passages and snippets are Python's own standard library (function
sources, and docstrings that are prose), so the workload is made here, from a fixed seed, with nothing
fetched; they change only with the interpreter's version, which the arm records. Every task is distinct:
the suffix proposer keeps the outputs of finished requests, and a task asked twice would be drafted from
its own earlier answer.
"""

from __future__ import annotations

import importlib
import inspect
import random
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

MODULES = (
    "textwrap",
    "heapq",
    "bisect",
    "shlex",
    "fnmatch",
    "posixpath",
    "colorsys",
    "calendar",
    "difflib",
    "statistics",
    "base64",
    "html",
    "urllib.parse",
    "email.utils",
    "string",
    "json.encoder",
    "json.decoder",
    "glob",
    "functools",
    "ipaddress",
    "fractions",
    "quopri",
    "zipfile",
    "tarfile",
    "csv",
    "gettext",
    "pprint",
    "copy",
    "tokenize",
    "tempfile",
    "shutil",
    "filecmp",
    "mimetypes",
    "platform",
    "http.cookiejar",
    "urllib.request",
    "sched",
    "subprocess",
    "logging",
    "datetime",
    "inspect",
    "ast",
    "traceback",
    "typing",
    "contextlib",
    "types",
)
CODE_EDITS = (
    "Add type hints to this Python function. Reply with the whole function.",
    "Add a short comment above each block of this Python function. Reply with the whole function.",
    "Rewrite this Python function so that its local variables have longer, clearer names. Reply with the whole "
    "function.",
    "Fix any bug you find in this Python function and reply with the corrected function in full.",
)
PROSE_EDITS = (
    "Rewrite the following passage in plain English, keeping every detail:",
    "Correct the grammar of the following text and reply with the corrected text in full:",
    "Summarise the following passage:",
)


@dataclass(frozen=True, slots=True)
class Task:
    kind: str  # "code" or "prose"
    source: str  # module.function it quotes
    prompt: str  # the user message


def _snippets() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(name, function source) of short functions and (name, docstring) of prose docstrings, stdlib order."""
    code: list[tuple[str, str]] = []
    prose: list[tuple[str, str]] = []
    for m in MODULES:
        mod = importlib.import_module(m)
        for name, f in sorted(vars(mod).items()):
            if not inspect.isfunction(f) or f.__module__ != mod.__name__ or name.startswith("__"):
                continue
            try:
                src = inspect.getsource(f)
            except (OSError, TypeError):
                continue
            if 8 <= src.count("\n") <= 28 and len(src) <= 1100:
                code.append((f"{m}.{name}", textwrap.dedent(src).strip()))
            doc = inspect.getdoc(f) or ""
            if 300 <= len(doc) <= 900 and sum(c.isalpha() or c == " " for c in doc) / len(doc) > 0.88:
                prose.append((f"{m}.{name}", doc))
    return code, prose


def tasks(n: int, seed: int = 0) -> list[Task]:
    """``n`` distinct tasks, code and prose alternating, in an order drawn from ``seed``."""
    code, prose = _snippets()
    rng = random.Random(seed)
    rng.shuffle(code)
    rng.shuffle(prose)
    made = [
        Task("code", name, f"{CODE_EDITS[i % len(CODE_EDITS)]}\n\n```python\n{src}\n```")
        for i, (name, src) in enumerate(code)
    ]
    said = [Task("prose", name, f"{PROSE_EDITS[i % len(PROSE_EDITS)]}\n\n{doc}") for i, (name, doc) in enumerate(prose)]
    both = [t for pair in zip(made, said) for t in pair]
    if n > len(both):
        raise ValueError(f"only {len(both)} tasks can be made, {n} asked")
    return both[:n]


def provenance(prompt: Sequence[int], output: Sequence[int], n: int = 4) -> dict[str, int]:
    """Where each output token's ``n``-gram (it and the ``n - 1`` tokens before it) comes from: ``quoted``
    (it occurs in the prompt), ``repeated`` (only earlier in the output: a small model's loops), ``new``.
    It says how much of a speedup is the quoting the workload asks for and how much the model's own
    repetition, which drafts predict as well."""
    seen_prompt = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    seq = [*prompt, *output]
    seen_output: set[tuple[int, ...]] = set()
    out = {"quoted": 0, "repeated": 0, "new": 0}
    for p in range(len(prompt), len(seq)):
        gram = tuple(seq[max(0, p - n + 1) : p + 1])
        if gram in seen_prompt:
            out["quoted"] += 1
        elif gram in seen_output:
            out["repeated"] += 1
        else:
            out["new"] += 1
        seen_output.add(gram)
    return out
