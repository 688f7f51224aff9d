"""What the job service and the workers share, each in one place (nothing here imports torch or etcd):

- :mod:`elastic.contract.env`: every ``ETRAIN_*`` variable (written by the node agent, read by the workers), and
  :class:`~elastic.contract.env.TorchrunEnv`, torchrun's own (``RANK``, ``LOCAL_RANK``, ...);
- :mod:`elastic.contract.recovery`: :class:`RecoveryMode`, the one vocabulary of how a job goes on after a
  failure (the job spec, ``--rdzv-conf recovery=``, ``ElasticConfig(recovery=)``);
- :mod:`elastic.contract.rendezvous`: the ``--rdzv-conf`` of the ``etcd-v3`` rendezvous, typed, with its defaults
  (the plugin parses it, the node agent renders it, the job spec's defaults come from it);
- :mod:`elastic.contract.lr`: the LR policy (its reference travels in the environment and in job specs);
- :mod:`elastic.contract.progress`: the progress wire format (rank 0 writes it, the controller reads it).
"""
