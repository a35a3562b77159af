"""``watch.load_tokenizer`` loads what ``AutoTokenizer`` loads from the same files, without importing torch
when the files name ``TokenizersBackend`` (real tokenizer files; no scheduler, no network)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from executor_svc.model_store import resolve_model
from scheduler_svc.frontend.watch import load_tokenizer

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
