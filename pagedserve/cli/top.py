"""``pagedserve top``: the deployment as ``deployment.py`` reads it, drawn with rich and refreshed until Ctrl-C.

pagedserve top --redis-url redis://host:6379/0 [--namespace NS] [--interval S] [--once]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.cli.deployment import (
    DEAD,
    LEFT,
    REFUSED,
    Deployment,
    ExecutorStatus,
    Rate,
    connect,
    rates,
    read,
)
from pagedserve.keys import Keys
from pagedserve.members import DRAINING, SERVING
from pagedserve.tiers import Tier

if TYPE_CHECKING:  # rich is imported when something is drawn
    from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
    from rich.table import Table
    from rich.text import Text


# -- rendering -----------------------------------------------------------------------


SHORT_ID = 12  # executor ids (32 hex digits) in ``top``, as docker shows container ids


def _bar(frac: float | None, width: int = 8) -> Text:
    from rich.text import Text

    if frac is None:
        return Text("-", style="dim")
    frac = min(max(frac, 0.0), 1.0)
    full = math.floor(frac * width + 0.5)
    style = "green" if frac < 0.7 else "yellow" if frac < 0.9 else "red"
    t = Text("█" * full, style=style)
    t.append("░" * (width - full), style="dim")
    t.append(f" {frac * 100:3.0f}%")
    return t


def _num(x: float | None, fmt: str = "{}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


_STATE_STYLE = {SERVING: "green", DRAINING: "yellow", REFUSED: "red", DEAD: "red", LEFT: "dim"}


def _state(e: ExecutorStatus, at_ms: int) -> Text:
    from rich.text import Text

    t = Text(e.state, style=_STATE_STYLE.get(e.state, ""))
    if e.state == DRAINING and e.evacuate_at_ms:
        left = (e.evacuate_at_ms - at_ms) / 1000
        t.append(f" {left:.0f}s" if left > 0 else " evac", style="yellow")
    if e.role != "mixed":
        t.append(f" {e.role}", style="magenta")  # --role: disaggregated prefill or decode
    if e.lent:
        t.append(f" ⇢{e.lent}", style="cyan")  # lends a peer is reading: moves out, pre-copies, asked prefixes
    if e.fetching:
        t.append(f" ⇠{e.fetching}", style="cyan")  # blocks it pulls from peers ahead of their requests
    return t


WIDE = 110  # console columns from which ``top`` shows executor addresses and swap usage

_EXECUTOR_COLUMNS = (
    "executor",
    "address",
    "state",
    "KV usage",
    "blocks",
    "swap",
    "run",
    "swp",
    "placed",
    "steps/s",
    "tok/s",
    "preempt",
)
_LEFT_ALIGNED = {"executor", "address", "state", "KV usage"}
_MIN_WIDTH = {"executor": 8, "state": 7, "KV usage": 13}  # the others: their header's width


def render(
    snap: Deployment, rate: tuple[dict[str, Rate], Rate] | None = None, error: str | None = None
) -> RenderableType:
    """One frame of ``top``: a header (queue, totals), the executors (KV usage bars), the replicas
    and the executors whose loops they lead (``(none)``: executors no loop steps right now). Fits
    the console: narrower than ``WIDE`` columns, it leaves out addresses and swap usage."""
    return _Frame(snap, rate, error)


@dataclass(frozen=True, slots=True)
class _Frame:
    snap: Deployment
    rate: tuple[dict[str, Rate], Rate] | None
    error: str | None

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        wide = options.max_width >= WIDE
        yield self._header()
        yield self._executors(wide)
        yield self._replicas()
        yield self._legend(wide)

    def _header(self) -> Text:
        """The namespace, model and time read; the queue; the namespace's counters, their rates once
        read twice; the last read's error, if it failed."""
        from rich.text import Text

        snap, rate = self.snap, self.rate
        t = snap.totals
        head = Text()
        head.append(f"pagedserve {snap.namespace}", style="bold")
        head.append(f"  {snap.model or '-'}  ")
        head.append(time.strftime("%H:%M:%S", time.localtime(snap.at_ms / 1000)), style="dim")
        head.append(
            f"\nrequests: {snap.waiting} waiting in the queue, {snap.live} unfinished, {snap.attached} attached"
        )
        head.append(
            f"\nsteps {t.get('steps', 0)}  preemptions {t.get('preemptions_swap', 0)} swap "
            f"{t.get('preemptions_recompute', 0)} recompute  swapped blocks "
            f"{t.get('swapped_out_blocks', 0)} out {t.get('swapped_in_blocks', 0)} in "
            f"{t.get('disk_spilled_blocks', 0)} to disk"
        )
        if drafted := t.get("spec_draft_tokens", 0):
            accepted = t.get("spec_accepted_tokens", 0)
            head.append(
                f"\nspeculative decoding: {accepted} of {drafted} drafted tokens accepted ({accepted / drafted:.0%})"
            )
        if rate is not None:
            r = rate[1]
            head.append(
                f"\n{_num(r.steps_per_s, '{:.1f}')} steps/s  {_num(r.tokens_per_s, '{:.1f}')} tokens/s  "
                f"{_num(r.preemptions_per_s, '{:.2f}')} preemptions/s"
            )
        if self.error:
            head.append(f"\n{self.error}", style="bold red")
        return head

    def _executors(self, wide: bool) -> Table:
        """One row per executor; narrower than ``WIDE``, without the address and swap columns and
        with shorter ids."""
        ex = _table("executors")
        keep = [c not in ("address", "swap") or wide for c in _EXECUTOR_COLUMNS]
        for name, k in zip(_EXECUTOR_COLUMNS, keep):
            if k:
                ex.add_column(
                    name,
                    justify="left" if name in _LEFT_ALIGNED else "right",
                    no_wrap=True,
                    overflow="ellipsis",
                    min_width=_MIN_WIDTH.get(name, len(name)),
                )
        lora = any(e.lora is not None for e in self.snap.executors)  # --enable-lora: a column of adapters
        if lora:
            ex.add_column("lora", no_wrap=True, overflow="ellipsis")
        short = SHORT_ID if wide else 8
        for e in self.snap.executors:
            er = self.rate[0].get(e.id) if self.rate is not None else None
            row = [v for v, k in zip(_executor_row(e, self.snap.at_ms, er, short), keep) if k]
            ex.add_row(*row, *([",".join(e.lora or ()) or "-"] if lora else []))
        return ex

    def _replicas(self) -> Table:
        """Each scheduler replica, its heartbeat and the loops it leads; then ``(none)``: the
        serving or draining executors whose loop nobody leads."""
        from rich.text import Text

        snap = self.snap
        rep = _table("scheduler replicas")
        rep.add_column("replica", no_wrap=True)
        rep.add_column("heartbeat", no_wrap=True)
        rep.add_column("leads the loops of")
        for rp in snap.replicas:
            rep.add_row(
                rp.id,
                Text("alive" if rp.alive else "expired", style="green" if rp.alive else "red"),
                " ".join(x[:SHORT_ID] for x in rp.leads) or "-",
            )
        unled = [e.id[:SHORT_ID] for e in snap.executors if e.leader is None and e.state in (SERVING, DRAINING)]
        if unled:
            rep.add_row(Text("(none)", style="red"), "-", " ".join(unled))
        return rep

    def _legend(self, wide: bool) -> Text:
        from rich.text import Text

        legend = (
            "blocks: device blocks used/total; "
            + ("swap: CPU+disk swap used; " if wide else "")
            + "run/swp: running/swapped requests; placed: requests on it; preempt: preemptions by "
            "swap/recompute; ⇢N: requests moving to peers with their KV; rates between the last two reads"
            + ("; lora: adapters in its slots" if any(e.lora is not None for e in self.snap.executors) else "")
        )
        if not self.snap.counts_tokens:
            legend += "; tok/s: these step commits do not count generated tokens"
        return Text(legend, style="dim")


def _table(title: str) -> Table:
    from rich import box
    from rich.table import Table

    return Table(
        box=box.SIMPLE_HEAD,
        padding=(0, 0),
        show_edge=False,
        title=title,
        title_justify="left",
        title_style="bold",
    )


def _executor_row(e: ExecutorStatus, at_ms: int, er: Rate | None, short: int) -> list[str | Text]:
    """Every column of ``_EXECUTOR_COLUMNS`` for ``e``; ``er``: its rates, None before a second read."""
    swap_total = e.blocks[Tier.CPU] + e.blocks[Tier.DISK]
    swap = None
    if e.free is not None and swap_total:
        swap = (swap_total - e.free[Tier.CPU] - e.free[Tier.DISK]) / swap_total
    used = None if e.free is None else e.blocks[Tier.DEVICE] - e.free[Tier.DEVICE]
    return [
        e.id[:short],
        e.address or "-",
        _state(e, at_ms),
        _bar(e.kv_usage),
        f"{_num(used)}/{e.blocks[Tier.DEVICE]}",
        _pct(swap),
        _num(e.running),
        _num(e.swapped),
        str(e.placed),
        _num(er.steps_per_s if er else None, "{:.1f}"),
        _num(er.tokens_per_s if er else None, "{:.1f}"),
        f"{e.counter('preemptions_swap')}/{e.counter('preemptions_recompute')}",
    ]


async def _top(url: str, namespace: str, interval: float, once: bool, console: Console) -> None:
    """Refresh until Ctrl-C. The first Ctrl-C only sets ``stop``: the frame in progress finishes
    and the loop ends (no cancellation inside the Redis client, which could lose it); a second one
    interrupts whatever is under way."""
    from rich.live import Live

    stop = asyncio.Event()

    def interrupt() -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, interrupt)
    except (NotImplementedError, RuntimeError):  # no signal handlers here: Ctrl-C cancels, as asyncio.run does
        pass
    client = connect(url)
    keys = Keys(namespace)
    try:
        prev = snap = await read(client, keys)
        if once:
            console.print(render(snap))
            return
        with Live(render(snap), console=console, auto_refresh=False, screen=False, transient=False) as live:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), interval)
                    break
                except TimeoutError:
                    pass
                try:
                    snap = await read(client, keys)
                except Exception as exc:  # noqa: BLE001  keep showing the last frame while Redis is away
                    live.update(render(snap, error=f"redis: {type(exc).__name__}: {exc}"), refresh=True)
                    continue
                live.update(render(snap, rates(prev, snap)), refresh=True)
                prev = snap
    finally:
        await client.aclose()


def top_main(args: argparse.Namespace, console: Console | None = None) -> int:
    from rich.console import Console

    console = console or Console()
    try:
        asyncio.run(_top(args.redis_url, args.namespace, args.interval, args.once, console))
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"error: {type(exc).__name__}: {exc}\n")
        return 1
    return 0
