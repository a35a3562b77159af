"""The bench's latency figures on plain records: pooling rounds of one workload, messages per token."""

from __future__ import annotations

from benchmarks.metrics import RequestRecord, pooled, summarize


def run(scale: float) -> tuple[list[RequestRecord], float]:
    """Two requests at once; each sends 4 tokens in messages ``scale`` s apart (the second's last two in one)."""
    a = RequestRecord(0, 8, 4, 0.0, scale, 4 * scale, [scale * i for i in (1, 2, 3, 4)])
    b = RequestRecord(1, 8, 4, 0.0, scale, 3 * scale, [scale * i for i in (1, 2, 3)])
    return [a, b], 4 * scale


def test_pooled_rounds_weigh_alike_and_never_overlap() -> None:
    one, two = run(1.0), run(2.0)
    records, duration = pooled([one, two])
    s = summarize(records, duration)
    assert duration == 12.0 and s["output_tokens"] == 16
    assert s["output_tokens_per_s"] == 16 / 12, "tokens over the rounds' time, not a mean of rates"
    assert s["peak_concurrent_seqs"] == 2, "the second round starts where the first ended"
    assert summarize(*one)["mean_concurrent_seqs"] == s["mean_concurrent_seqs"]
    gaps = sorted([1.0] * 5 + [2.0] * 5)
    assert s["itl_ms"]["p50"] == 1e3 * (gaps[4] + gaps[5]) / 2 and s["itl_ms"]["mean"] == 1e3 * sum(gaps) / 10
    assert [r.arrival for r in records] == [0.0, 0.0, 4.0, 4.0]


def test_messages_per_token_counts_merged_messages() -> None:
    s = summarize(*run(1.0))
    assert s["messages_per_token"] == 7 / 8
