"""``pagedserve status``: a deployment as its shared state in Redis says (``pagedserve top`` draws it: ``top.py``).

    pagedserve status --json --redis-url redis://host:6379/0 [--namespace NS] [--interval S]
    pagedserve top --redis-url redis://host:6379/0 [--namespace NS] [--interval S] [--once]

The snapshot itself — how it is read from the namespace's keys, built, and turned into rates —
is ``deployment.py``; here ``to_json`` / ``_text`` print one for scripts / people, and the
arguments both commands share. Rates need two reads, so ``status`` shows them only with
``--interval``; tokens per second are unknown (``null``) until step commits count generated tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Mapping
from typing import Any, cast

from pagedserve.cli.deployment import GENERATED, Deployment, Rate, connect, rates, read
from pagedserve.keys import Keys
from pagedserve.tiers import TIERS


def _tiers(values: tuple[int, ...] | None) -> dict[str, int] | None:
    return None if values is None else {t.label: int(values[t]) for t in TIERS}


# -- JSON ---------------------------------------------------------------------------


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _rate_json(r: Rate) -> dict[str, float | None]:
    return {
        "steps_per_s": _round(r.steps_per_s, 2),
        "tokens_per_s": _round(r.tokens_per_s, 2),
        "preemptions_per_s": _round(r.preemptions_per_s, 2),
    }


def _counters_json(c: Mapping[str, int], counts_tokens: bool) -> dict[str, object]:
    return {
        "steps": c.get("steps", 0),
        "generated": c.get(GENERATED, 0) if counts_tokens else None,
        "preemptions": {"swap": c.get("preemptions_swap", 0), "recompute": c.get("preemptions_recompute", 0)},
        "swapped_blocks": {
            "out": c.get("swapped_out_blocks", 0),
            "in": c.get("swapped_in_blocks", 0),
            "disk_spilled": c.get("disk_spilled_blocks", 0),
        },
        # Speculative decoding (--speculative-config): rows that drafted, drafted tokens, accepted ones.
        "spec_decode": {
            "drafts": c.get("spec_drafts", 0),
            "draft_tokens": c.get("spec_draft_tokens", 0),
            "accepted_tokens": c.get("spec_accepted_tokens", 0),
        },
        # KV that moves: requests that left with their KV, by cause; pulls ahead of requests, by cause.
        "moves": {
            "out": {cause: c.get(f"migrations_{cause}", 0) for cause in ("drain", "rebalance", "preempt")},
            "in": c.get("migrations_in", 0),
            "failed": c.get("migrations_failed", 0),
            "precopied_blocks": c.get("precopy_blocks", 0),
            "peer_prefix_blocks": c.get("prefix_blocks", 0),
            "peer_prefix_asks": c.get("peer_prefix_asks", 0),
        },
    }


def to_json(snap: Deployment, rate: tuple[dict[str, Rate], Rate] | None = None) -> dict[str, object]:
    """The snapshot for scripts (``pagedserve status --json``). ``rate``: from ``rates``, if sampled twice."""
    execs = []
    for e in snap.executors:
        d: dict[str, object] = {
            "id": e.id,
            "address": e.address,
            "model": e.model,
            "state": e.state,
            "leader": e.leader,
            "role": e.role,
            "block_size": e.block_size,
            "blocks": _tiers(e.blocks),
            "free": _tiers(e.free),
            "kv_usage": _round(e.kv_usage),
            "running": e.running,
            "swapped": e.swapped,
            "max_num_seqs": e.max_num_seqs,
            "placed": e.placed,
            "migrating": e.lent,
            "fetching": e.fetching,
            **_counters_json(e.counters, snap.counts_tokens),
            "evacuate_at_ms": e.evacuate_at_ms,
            **({"lora_adapters": list(e.lora)} if e.lora is not None else {}),
        }
        if rate is not None:
            r = rate[0].get(e.id)
            d["rates"] = None if r is None else _rate_json(r)
        execs.append(d)
    pools = [e for e in snap.executors if e.free is not None]
    totals: dict[str, object] = {
        "executors": len(snap.executors),
        "blocks": {t.label: sum(e.blocks[t] for e in snap.executors) for t in TIERS},
        "free": {t.label: sum(e.free[t] for e in pools if e.free is not None) for t in TIERS},
        "running": sum(e.running or 0 for e in snap.executors),
        "swapped": sum(e.swapped or 0 for e in snap.executors),
        "placed": sum(e.placed for e in snap.executors),
        **_counters_json(snap.totals, snap.counts_tokens),
    }
    if rate is not None:
        totals["rates"] = _rate_json(rate[1])
    return {
        "namespace": snap.namespace,
        "model": snap.model,
        "at_ms": snap.at_ms,
        "executors": execs,
        "queue": {"waiting": snap.waiting, "live": snap.live, "attached": snap.attached},
        "replicas": [{"id": r.id, "alive": r.alive, "leads": list(r.leads)} for r in snap.replicas],
        "totals": totals,
    }


# -- commands ---------------------------------------------------------------------------


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def add_arguments(p: argparse.ArgumentParser, *, interval: float | None) -> None:
    p.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL"), help="the deployment's Redis (default: $REDIS_URL)"
    )
    p.add_argument("--namespace", default="pagedserve", help="the deployment's key prefix (default: pagedserve)")
    p.add_argument(
        "--interval",
        type=_seconds,
        default=interval,
        help=f"seconds between reads (default {interval})"
        if interval is not None
        else "read twice this many seconds apart and add per-second rates",
    )


async def status(url: str, namespace: str, interval: float | None = None) -> dict[str, object]:
    client = connect(url)
    keys = Keys(namespace)
    try:
        snap = await read(client, keys)
        if not interval:
            return to_json(snap)
        await asyncio.sleep(interval)
        after = await read(client, keys)
        return to_json(after, rates(snap, after))
    finally:
        await client.aclose()


def _text(doc: dict[str, object]) -> str:
    """``pagedserve status`` without ``--json``: one line per executor."""
    q: dict = doc["queue"]  # type: ignore[assignment]
    lines = [
        f"namespace {doc['namespace']}  model {doc['model'] or '-'}  requests: {q['waiting']} waiting, "
        + f"{q['live']} unfinished, {q['attached']} attached"
    ]
    for e in cast(list[dict[str, Any]], doc["executors"]):
        usage = "-" if e["kv_usage"] is None else f"{e['kv_usage'] * 100:.0f}%"
        lines.append(
            f"  {e['id']}  {e['address']}  {e['state']}"
            + (f" ({e['role']})" if e.get("role", "mixed") != "mixed" else "")
            + f"  kv {usage}  running {e['running']}  "
            f"swapped {e['swapped']}  placed {e['placed']}  steps {e['steps']}  leader {e['leader']}"
            + (f"  migrating {e['migrating']}" if e.get("migrating") else "")
            + (f"  fetching {e['fetching']}" if e.get("fetching") else "")
            + (f"  lora {','.join(e['lora_adapters']) or '-'}" if "lora_adapters" in e else "")
        )
    for r in cast(list[dict[str, Any]], doc["replicas"]):
        lines.append(
            f"  replica {r['id']} ({'alive' if r['alive'] else 'expired'}) leads {', '.join(r['leads']) or '-'}"
        )
    return "\n".join(lines)


def status_main(args: argparse.Namespace) -> int:
    try:
        doc = asyncio.run(status(args.redis_url, args.namespace, args.interval))
    except Exception as exc:  # noqa: BLE001  (Redis unreachable, bad URL)
        sys.stderr.write(f"error: {type(exc).__name__}: {exc}\n")
        return 1
    print(json.dumps(doc, indent=2) if args.json else _text(doc), flush=True)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("status", help="the deployment as Redis holds it: executors, queue, replicas (once)")
    add_arguments(st, interval=None)
    st.add_argument("--json", action="store_true", help="one JSON object (top-level key `executors`), for scripts")
    tp = sub.add_parser("top", help="the deployment as Redis holds it, refreshing until Ctrl-C")
    add_arguments(tp, interval=1.0)
    tp.add_argument("--once", action="store_true", help="print one frame and exit")
