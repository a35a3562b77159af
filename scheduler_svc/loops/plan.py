"""A scheduler decision as the executor's StepPlan protobuf.

Block tables travel as diffs: ``PlanBuilder`` remembers how many blocks of each
request the executor holds and sends only the new ones, or the whole table the
first time, after a preemption, and after any failure (a fresh builder).

Built before ``Scheduler.launch``: a position whose token a launched step has
not reported yet (the pipelined loop plans one step ahead) travels as
``from_last_sample``, and the executor puts its own sampled token there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.tiers import BlockMove
from scheduler_svc.core.logprob import Logprob
from scheduler_svc.core.migration import Lent, PullPlan
from scheduler_svc.core.output import Scheduled, SchedulerOutput
from scheduler_svc.core.request import Params, Request


def _grammar(p: Params) -> pb.Grammar | None:
    return pb.Grammar(kind=p.grammar[0], spec=p.grammar[1]) if p.grammar else None


def _moves(moves: list[BlockMove]) -> list[pb.BlockMove]:
    return [pb.BlockMove(src_tier=m.src_tier.to_pb(), src=m.src, dst_tier=m.dst_tier.to_pb(), dst=m.dst) for m in moves]


def _refs(blocks: Iterable[tuple[int, int]]) -> list[pb.BlockRef]:
    return [pb.BlockRef(tier=cast(pb.Tier, int(t)), block=b) for t, b in blocks]


def _lends(lends: list[Lent]) -> list[pb.Lend]:
    return [pb.Lend(lend_id=x.lend_id, blocks=_refs(x.blocks)) for x in lends]


def _pulls(pulls: list[PullPlan]) -> list[pb.Pull]:
    return [
        pb.Pull(
            request_id=p.key,
            address=p.src.address,
            src_instance_id=p.src.executor,
            src_epoch=p.src.epoch,
            lend_id=p.src.lend,
            src=_refs(p.src_blocks),
            dst=p.dst,
        )
        for p in pulls
    ]


def pulls_of(result: pb.StepResult | None) -> dict[str, tuple[bool, float, int]]:
    """Each reported pull's (ok, ms, bytes), by request."""
    return {} if result is None else {p.request_id: (p.ok, p.ms, p.bytes) for p in result.pulls}


def needs_history(params: Params) -> bool:
    """Whether the executor must hold the request's tokens to sample it (penalties count them; a
    grammar matcher is rebuilt from them; a bad word's prefix is matched against them): then a full
    table with start_pos > 0 carries them (SeqPlan.history)."""
    return params.penalized or params.grammar is not None or params.bad_word_prefixes


def sampling_of(p: Params) -> pb.Sampling:
    """The executor's view of ``p`` that holds for every step (built once per request); the options
    a request leaves unset cost nothing on the wire."""
    out = pb.Sampling(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed)
    if p.min_p or p.penalized:
        out.min_p, out.presence_penalty, out.frequency_penalty = p.min_p, p.presence_penalty, p.frequency_penalty
        out.repetition_penalty = p.repetition_penalty
    if p.logit_bias:
        out.logit_bias.update(dict(p.logit_bias))
    if p.grammar:
        out.grammar.CopyFrom(_grammar(p))
    if p.logprobs is not None:
        out.logprobs = p.logprobs
    if p.allowed_token_ids:
        out.allowed_token_ids.extend(p.allowed_token_ids)
    if p.bad_words:
        out.bad_words.extend(pb.TokenSequence(token_ids=w) for w in p.bad_words)
    return out


def for_chunk(base: pb.Sampling, req: Request, s: Scheduled, generated: int) -> pb.Sampling:
    """``base`` plus what depends on the step: the ``min_tokens`` mask while fewer than
    ``min_tokens`` outputs exist (``generated`` counts the one in flight), and a prompt chunk's
    prompt logprobs (with the prompt token after it). Most steps of most requests are ``base``."""
    p = req.params
    plen = len(req.prompt_ids)
    masks = bool(p.min_tokens) and generated < p.min_tokens
    prompt = p.prompt_logprobs is not None and not req.output_ids and s.start < plen
    if not masks and not prompt:
        return base
    out = pb.Sampling()
    out.CopyFrom(base)
    if masks:
        out.min_tokens.CopyFrom(
            pb.MinTokens(count=p.min_tokens, stop_token_ids=p.stop_token_ids, include_eos=not p.ignore_eos)
        )
    if prompt:
        end = s.start + s.num_tokens
        out.prompt_logprobs.CopyFrom(
            pb.PromptLogprobs(top=p.prompt_logprobs, next_token=req.prompt_ids[end] if end < plen else None)
        )
    return out


def entry(lp: pb.Logprobs) -> Logprob:
    """One position's logprobs, from the executor's reply."""
    return Logprob(lp.token_id, lp.logprob, lp.rank, tuple(lp.top_ids), tuple(lp.top_logprobs))


def outputs(
    result: pb.StepResult | None,
) -> tuple[
    dict[str, int], dict[str, Logprob], dict[str, dict[int, Logprob]], dict[str, list[int]], dict[str, list[Logprob]]
]:
    """A step's result for ``Scheduler.update``: sampled tokens, their logprobs, prompt logprobs by
    position, and the tokens after the first of rows that ran drafts, with their logprobs."""
    if result is None:
        return {}, {}, {}, {}, {}
    more: dict[str, list[int]] = {}
    more_lps: dict[str, list[Logprob]] = {}
    sampled: dict[str, int] = {}
    lps: dict[str, Logprob] = {}
    prompt: dict[str, dict[int, Logprob]] = {}
    for o in result.outputs:
        if not o.no_token:
            sampled[o.request_id] = o.token_id
            if o.HasField("logprobs"):
                lps[o.request_id] = entry(o.logprobs)
            if o.more_token_ids:
                more[o.request_id] = list(o.more_token_ids)
            if o.more_logprobs:
                more_lps[o.request_id] = [entry(e) for e in o.more_logprobs]
        if o.prompt_logprobs:
            prompt[o.request_id] = {o.prompt_start + i: entry(e) for i, e in enumerate(o.prompt_logprobs)}
    return sampled, lps, prompt, more, more_lps


class PlanBuilder:
    def __init__(self, epoch: int = 0, instance_id: str = "") -> None:
        self.epoch = epoch  # the loop's fencing epoch and the executor's instance, both checked there
        self.instance_id = instance_id
        # request id -> (blocks of its table the executor holds, the request's ``table_cuts`` when they were sent)
        self._sent: dict[str, tuple[int, int]] = {}
        # request id -> its Sampling message, built once (a decode step's plan is built 256 times a step;
        # copying a built message is a third of building it)
        self._sampling: dict[str, pb.Sampling] = {}
        self._first = True

    def build(self, out: SchedulerOutput, step_id: int, ended: list[str], seq: int = 0) -> pb.StepPlan:
        """``ended``: requests finished or aborted since the last plan; ``seq``: the writes of the
        executor's state in Redis this plan is built on."""
        forget = [r.request_id for r in out.preempted] + ended
        for rid in forget:
            self._sent.pop(rid, None)
            self._sampling.pop(rid, None)
        plan = pb.StepPlan(
            step_id=step_id,
            swap_out=_moves(out.swap_out),
            swap_in=_moves(out.swap_in),
            copies=_moves(out.copies),
            forget=forget,
            reset_tables=self._first,
            epoch=self.epoch,
            instance_id=self.instance_id,
            seq=seq,
        )
        if out.lends or out.unlends or out.pulls:
            plan.lends.extend(_lends(out.lends))
            plan.unlends.extend(out.unlends)
            plan.pulls.extend(_pulls(out.pulls))
        add = plan.seqs.add
        for s in out.scheduled:
            req = s.req
            rid = req.request_id
            sampling = self._sampling.get(rid)
            if sampling is None:
                sampling = self._sampling[rid] = sampling_of(req.params)
            sent = self._sent.get(rid)
            # Blocks reserved for rejected drafts were freed since (and maybe others taken): the table goes in full.
            known = sent[0] if sent is not None and sent[1] == req.table_cuts else None
            self._sent[rid] = (len(req.blocks), req.table_cuts)
            end = s.end
            unreported = end - req.num_known  # 1: the last position's token is in flight; else 0 or less
            if unreported > 1:
                raise ValueError(f"{rid}: {unreported} unreported tokens in one plan (at most one)")
            generated = len(req.output_ids) + req.num_unreported
            seq_pb = add(
                request_id=rid,
                start_pos=s.start,
                sampling=for_chunk(sampling, req, s, generated),
                sample=s.samples,
                num_generated=generated,
                full_table=known is None,
                from_last_sample=unreported == 1,
            )
            if req.lora is not None:  # every step: the executor keeps no per-request adapter state
                seq_pb.lora.digest, seq_pb.lora.path, seq_pb.lora.name = req.lora.digest, req.lora.path, req.lora.name
            # Empty repeated fields cost as much as the rest of the message: filled only when there is something.
            if unreported < 1 or s.num_tokens > 1:
                seq_pb.token_ids.extend(req.tokens(s.start, min(end, req.num_known)))
            if known is None:
                seq_pb.block_table.extend(req.blocks)
                if s.start > 0 and needs_history(req.params):
                    seq_pb.history.extend(req.tokens(0, s.start))
            elif known < len(req.blocks):
                seq_pb.block_table.extend(req.blocks[known:])
            if s.drafts:
                seq_pb.draft_token_ids.extend(s.drafts)
        self._first = False
        return plan
