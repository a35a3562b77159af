"""What moving KV and computing it cost on this executor, measured online.

A request placed here whose prefix a peer caches can either compute that
prefix (prefill) or pull the peer's blocks (core/migration.py: ``Ask``). Which
is cheaper depends on the model, the machine, the load and the network, so no
constant decides it; each loop learns both from what its executor reports:

- **prefill**: the marginal forward time of a token, the slope of a
  least-squares line through (tokens in the step, ``StepResult.forward_ms``)
  over recent steps (exponentially weighted, so it follows the load); with too
  little spread in step sizes, the mean time per token (an upper bound of the
  slope);
- **pull**: the executor's reported time per block pulled (``PullResult.ms``);
- **ask**: the wait from an ask to its offer (two loops' turns, and the
  holder's plan registering the lend);
- **copy**: the executor's reported time per block copied between its tiers
  (``StepResult.copy_ms`` over the step's swap-ins, swap-outs and copies).

``pull_pays`` compares ask + pull against the prefill the blocks save;
``swap_pays`` compares a preempted request's copies out and back against
recomputing its tokens (``--preemption-mode auto``). Until a cost has been seen
once it counts as free (so the first pull or swap is tried and then measured);
until a step has been seen, prefill is unknown and moving wins.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.95  # weight of the past per observation: about the last 20 steps (or pulls) count
MIN_SPREAD = 16.0  # tokens: below this standard deviation of step sizes the slope is not trusted


@dataclass(slots=True)
class Ewma:
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else DECAY * self.value + (1 - DECAY) * x


@dataclass(slots=True)
class Line:
    """y ≈ a + b·x over exponentially weighted observations."""

    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.w = DECAY * self.w + 1
        self.sx = DECAY * self.sx + x
        self.sy = DECAY * self.sy + y
        self.sxx = DECAY * self.sxx + x * x
        self.sxy = DECAY * self.sxy + x * y

    def slope(self) -> float | None:
        if self.w == 0 or self.sx <= 0:
            return None
        var = self.sxx / self.w - (self.sx / self.w) ** 2
        if var >= MIN_SPREAD**2:
            b = (self.w * self.sxy - self.sx * self.sy) / (self.w * self.sxx - self.sx * self.sx)
            if b > 0:
                return b
        return self.sy / self.sx


@dataclass(slots=True)
class Costs:
    prefill: Line
    pull_ms_per_block: Ewma
    ask_ms: Ewma
    copy_ms_per_block: Ewma

    @classmethod
    def fresh(cls) -> Costs:
        return cls(Line(), Ewma(), Ewma(), Ewma())

    def stepped(self, tokens: int, forward_ms: float) -> None:
        if tokens > 0 and forward_ms > 0:
            self.prefill.add(tokens, forward_ms)

    def pulled(self, blocks: int, ms: float) -> None:
        if blocks > 0 and ms > 0:
            self.pull_ms_per_block.add(ms / blocks)

    def copied(self, blocks: int, ms: float) -> None:
        if blocks > 0 and ms >= 0:
            self.copy_ms_per_block.add(ms / blocks)

    def answered(self, ms: float) -> None:
        self.ask_ms.add(max(0.0, ms))

    def prefill_ms(self, tokens: int) -> float | None:
        b = self.prefill.slope()
        return None if b is None else b * tokens

    def move_ms(self, blocks: int) -> float:
        return (self.ask_ms.value or 0.0) + (self.pull_ms_per_block.value or 0.0) * blocks

    def pull_pays(self, blocks: int, block_size: int) -> bool:
        """Whether pulling ``blocks`` from a peer (ask, then pull) costs less than computing their tokens."""
        if blocks <= 0:
            return False
        prefill = self.prefill_ms(blocks * block_size)
        return prefill is None or self.move_ms(blocks) < prefill

    def swap_pays(self, blocks: int, tokens: int) -> bool:
        """Whether swapping out ``blocks`` and back in (two copies each) costs less than recomputing the
        ``tokens`` they hold. On a CPU executor the copies are memcpys within one memory (a 512-token
        request: 9 ms out and back against 470 ms recomputed); over PCIe, a small model may recompute
        faster."""
        if blocks <= 0:
            return False
        prefill = self.prefill_ms(tokens)
        return prefill is None or 2 * (self.copy_ms_per_block.value or 0.0) * blocks < prefill

    def as_dict(self) -> dict[str, float | None]:
        return {
            "prefill_ms_per_token": self.prefill.slope(),
            "pull_ms_per_block": self.pull_ms_per_block.value,
            "ask_ms": self.ask_ms.value,
            "copy_ms_per_block": self.copy_ms_per_block.value,
        }
