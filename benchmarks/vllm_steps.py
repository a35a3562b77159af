"""vLLM's decode step on the shapes of ``benchmarks.machine``'s model-runner ratio: batch B rows of ``context``
cached tokens, one new token each.

Runs in vLLM's own virtualenv (``python benchmarks/vllm_steps.py CONFIG_JSON``, started by ``vllm_runner``), so
it imports nothing of this project. vLLM's offline ``LLM`` (engine core in this process) generates, for each
batch size, ``max_tokens=1`` then ``1 + steps`` tokens from the same token-id prompts with ``ignore_eos``; the
difference over ``steps`` is one decode step of its engine: scheduler, model runner (forward and sampling) and
output processing, the work our executor's ``Engine.step`` plus the loop's plan do. Each pair is repeated and the
median kept. Prints one JSON object: ``{"step_ms": {batch: ms}, "startup_s": s}``.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time


def main() -> None:
    cfg = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core here: no IPC in the timing
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t = time.perf_counter()
    llm = LLM(
        model=cfg["model_dir"],
        dtype="float32",
        block_size=cfg["block_size"],
        kv_cache_memory_bytes=cfg["kv_bytes"],
        max_model_len=cfg["max_model_len"],
        max_num_seqs=max(cfg["batches"]),
        enforce_eager=cfg["enforce_eager"],
        seed=0,
    )
    startup = time.perf_counter() - t
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    out: dict[str, float] = {}
    for batch in cfg["batches"]:
        prompts = [
            TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(cfg["context"])])
            for _ in range(batch)
        ]

        def run(n: int, prompts: list = prompts) -> float:
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - t

        run(1 + cfg["steps"])  # warm-up; the prompts are in the prefix cache from here on, for both runs alike
        per_step = [(run(1 + cfg["steps"]) - run(1)) / cfg["steps"] * 1e3 for _ in range(cfg["reps"])]
        out[str(batch)] = round(statistics.median(per_step), 2)
    print(json.dumps({"step_ms": out, "startup_s": round(startup, 1)}))


if __name__ == "__main__":
    main()
