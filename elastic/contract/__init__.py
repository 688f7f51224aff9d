"""What the job service and the workers share, each in one place (nothing here imports torch or etcd):

- :mod:`elastic.contract.env`: every ``ETRAIN_*`` variable (written by the node agent, read by the workers);
- :mod:`elastic.contract.recovery`: :class:`RecoveryMode`, the one vocabulary of how a job goes on after a
  failure (the job spec, ``--rdzv-conf recovery=``, ``ElasticConfig(recovery=)``);
- :mod:`elastic.contract.lr`: the LR policy (its reference travels in the environment and in job specs);
- :mod:`elastic.contract.progress`: the progress wire format (rank 0 writes it, the controller reads it).
"""
