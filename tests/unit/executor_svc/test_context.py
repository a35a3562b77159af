"""``executor_svc.context``: a ``--max-model-len`` the device pool cannot hold is refused, naming what fits."""

from __future__ import annotations

import pytest

from executor_svc.context import ContextTooLong, check_max_model_len, pool_tokens


def test_a_max_model_len_over_the_pool_is_refused_with_the_number_that_fits() -> None:
    assert pool_tokens(24, 16) == 384
    for ok in (None, 1, 384):
        check_max_model_len(ok, 24, 16)
    want = r"--max-model-len 385: the KV pool holds 384 tokens .*--max-model-len 384"
    with pytest.raises(ContextTooLong, match=want):
        check_max_model_len(385, 24, 16)
