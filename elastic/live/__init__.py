"""Live recovery: the workers keep their processes through failures and joins (``recovery="live"``).

- :mod:`elastic.live.protocol`: the etcd layout and the pure decisions (generations, settle, sync plan);
- :mod:`elastic.live.membership`: a worker's registration and the generation transactions, on any
  :class:`~elastic.etcd.EtcdClient` (the in-memory one in tests);
- :mod:`elastic.live.group`: the process group per generation, its teardown, the stuck-collective watchdog;
- :mod:`elastic.live.state_sync`: state from one member to the others by broadcast;
- :mod:`elastic.live.buckets`, :mod:`elastic.live.grads`: the gradient all-reduce without DDP, overlapped with
  the backward pass.

The trainer's part (the group from the worker's environment, attempts, late records, the sync after a
re-form) is :mod:`elastic.train.live`: this package does not import the loop.

See docs/live-recovery.md.
"""
