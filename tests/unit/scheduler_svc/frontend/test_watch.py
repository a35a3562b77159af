"""``watch.load_tokenizer`` loads what ``AutoTokenizer`` loads from the same files, without importing torch
when the files name ``TokenizersBackend`` (real tokenizer files; no scheduler, no network); ``watch.limits_of``
on plain members."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from executor_svc.model_store import resolve_model
from pagedserve.members import Member
from scheduler_svc.frontend.watch import limits_of, load_tokenizer

TEXTS = ["Hello world, this is ünïcode 日本 and \t tabs", " leading space", "<|im_start|>user\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def _files(model_dir: Path, **config_changes: object) -> dict[str, bytes]:
    files = {
        p.name: p.read_bytes()
        for p in model_dir.iterdir()
        if p.name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
    }
    if config_changes:
        config = json.loads(files["tokenizer_config.json"])
        files["tokenizer_config.json"] = json.dumps({**config, **config_changes}).encode()
    return files


def _same(a: object, b: object) -> None:
    assert type(a) is type(b)
    for text in TEXTS:
        assert a(text).input_ids == b(text).input_ids
    ids = b(TEXTS[0]).input_ids + [1, 2, 3]
    assert a.decode(ids) == b.decode(ids)
    assert a.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == b.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    assert a.eos_token_id == b.eos_token_id and a.all_special_ids == b.all_special_ids


def test_tokenizers_backend_files_load_as_auto_tokenizer_loads_them() -> None:
    smol = resolve_model(None)
    assert json.loads((smol / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    _same(load_tokenizer(_files(smol)), AutoTokenizer.from_pretrained(smol))


def test_other_tokenizer_classes_go_through_auto_tokenizer(tmp_path: Path) -> None:
    files = _files(resolve_model(None), tokenizer_class="GPT2Tokenizer")
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    _same(load_tokenizer(files), AutoTokenizer.from_pretrained(tmp_path))


def test_the_fast_path_imports_no_torch() -> None:
    code = (
        "import sys; from executor_svc.model_store import resolve_model; from scheduler_svc.frontend.watch import "
        "load_tokenizer; d = resolve_model(None); load_tokenizer({p.name: p.read_bytes() for p in d.iterdir() "
        "if p.name.startswith(('tokenizer', 'special', 'chat'))}); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


def _member(blocks: int, max_model_len: int) -> Member:
    return Member(f"e{blocks}", "h:1", "m", "d", "float32", 16, (blocks, 0, 0), max_model_len)


def test_max_model_len_is_what_the_largest_pool_holds_for_one_request_capped_by_the_context() -> None:
    assert limits_of([_member(24, 512)], 100).max_model_len == 24 * 16  # the pool is smaller
    assert limits_of([_member(40, 512)], 100).max_model_len == 512  # the context is
    assert limits_of([_member(40, 512)], 100, max_model_len=300).max_model_len == 300  # the scheduler's cap
    two = limits_of([_member(8, 512), _member(24, 256)], 100)
    assert two.max_model_len == 256 and two.pools == ((8, 512), (24, 256))  # each pool checked on its own
