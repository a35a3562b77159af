"""The scheduler's pure core: requests, block accounting, queues, policy.

No I/O here: everything is plain data so it can be tested without Redis,
gRPC or a model. ``scheduler_svc.state.store`` persists it, ``scheduler_svc.loops.loop``
drives it.
"""
