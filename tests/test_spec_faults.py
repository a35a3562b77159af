"""Faults while speculative requests decode (real redis-server, real processes, gRPC, tiny Llama): the
scheduler replica whose loop drafts for the executor is SIGKILLed (its API process and its loop), and an
executor is SIGKILLed. Clients stream through the resuming client library (each token exactly once, in
order: offsets checked); every greedy output equals transformers'; drafts were accepted before the kill
and after it (by the loop that took over, or on the surviving executor); no block is left held.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import psutil
import redis

from pagedserve.keys import Keys
from tests.conftest import make_cluster
from tests.helpers import counters, executors, greedy, wait_all_free
from tests.test_e2e_oracle import hf_greedy
from tests.test_failover import generated
from tests.test_scale_out import busiest, placed, wait_for
from tests.test_spec_decode import NGRAM, SUFFIX, repeating_prompts
from tests.test_streams import Streams, kill_replica

FAST = ["--lease-ms", "3000"]
MAX_TOKENS = 300  # prompts of 36-57 tokens: within the tiny model's 512


def spec_args(cfg: dict) -> list[str]:
    # Two requests at a time: the other six wait in the queue, so the run outlasts the kill and the handover.
    return [*FAST, "--max-num-seqs", "2", "--speculative-config", json.dumps(cfg)]


def speculating(client: redis.Redis, ns: str) -> bool:
    """Drafts were accepted and the live requests have 40 tokens between them: the kill lands mid-speculation
    (each test then asserts drafts were accepted after it too; two requests run per executor, the rest queue)."""
    return counters(client, ns).get("spec_accepted_tokens", 0) > 0 and generated(client, ns) >= 40


def test_the_replica_running_a_drafting_loop_is_killed(tiny_llama: Path, redis_url: str, tmp_path: Path) -> None:
    prompts = repeating_prompts(11)
    expected = hf_greedy(tiny_llama, prompts, [MAX_TOKENS] * len(prompts))
    ns = "spec-kill-loop"
    keys = Keys(ns)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(tiny_llama, redis_url, ns, tmp_path, blocks=128, scheduler_args=spec_args(NGRAM)) as cluster:
        doomed = cluster.scheduler
        wait_for(lambda: len(executors(client, ns)) == 1, what="the loop's first view of the pool")
        (executor,) = executors(client, ns)
        wait_for(lambda: client.get(keys.executor(executor).leader) is not None, what="a loop leading the executor")
        kids = psutil.Process(doomed.proc.pid).children()
        assert len(kids) == 1, [(k.pid, k.cmdline()) for k in kids]
        assert client.get(keys.executor(executor).leader).split("-")[-2] == str(kids[0].pid)
        survivor = cluster.start_scheduler(spec_args(NGRAM))
        epoch = int(client.get(keys.executor(executor).epoch))
        streams = Streams([[doomed.address, survivor.address]] * len(prompts), [greedy(p, MAX_TOKENS) for p in prompts])
        wait_for(lambda: speculating(client, ns), what="drafts accepted, decoding under way")
        before = counters(client, ns)
        kill_replica(doomed)
        got = streams.join()
        after = counters(client, ns)
        assert int(client.get(keys.executor(executor).epoch)) > epoch, "the survivor's loop took the lease"
        free, totals = wait_all_free(client, ns)
    assert got == expected, "every token once, transformers' tokens"
    assert after["spec_accepted_tokens"] > before["spec_accepted_tokens"], "the new loop drafted too"
    assert free == totals, "no block left held"


def test_an_executor_killed_mid_speculation(tiny_llama: Path, redis_url: str, tmp_path: Path) -> None:
    prompts = repeating_prompts(12)
    expected = hf_greedy(tiny_llama, prompts, [MAX_TOKENS] * len(prompts))
    ns = "spec-kill-executor"
    keys = Keys(ns)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=128,
        executors=2,
        executor_args=FAST,
        scheduler_args=spec_args(SUFFIX),
    ) as cluster:
        wait_for(lambda: len(executors(client, ns)) == 2, what="two loops")
        streams = Streams([[cluster.address]] * len(prompts), [greedy(p, MAX_TOKENS) for p in prompts])
        wait_for(lambda: all(placed(client, ns).values()), what="requests on both executors")
        wait_for(lambda: speculating(client, ns), what="drafts accepted, decoding under way")
        victim, dead = busiest(cluster, client, ns)
        before = counters(client, ns)
        victim.proc.send_signal(signal.SIGKILL)
        got = streams.join()
        after = counters(client, ns)
        wait_for(lambda: len(executors(client, ns)) == 1, what="the dead executor reaped")
        assert client.zscore(keys.evicted, dead) is not None, "the dead instance was evicted"
        assert not any(client.exists(k) for k in keys.executor(dead).all()), "its pool state is gone"
        free, totals = wait_all_free(client, ns)
    assert got == expected, "every token once, transformers' tokens (the dead executor's requests recomputed)"
    assert after["spec_accepted_tokens"] > before["spec_accepted_tokens"], "the survivor drafted on"
    assert free == totals, "the survivor's pool is all free"
