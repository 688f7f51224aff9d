"""The elastic loop's guarantees inside training frameworks that own their loop (docs/integrations.md).

Each framework's adapter is a module of its own, importable once its extra is installed:

- :mod:`elastic.integrations.hf`: Hugging Face ``transformers.Trainer`` (``pip install elastic-train[hf]``):
  ``trainer = make_elastic(trainer, checkpoint_url=..., base_world_size=...)``;
- :mod:`elastic.integrations.accelerate`: a script's own loop with an ``accelerate.Accelerator`` (``[hf]``);
- :mod:`elastic.integrations.session`: the framework-free part they share, the loop's pieces (cursor, sampler, LR
  gate, snapshots, SIGTERM save) driven from a framework's step boundary.

Nothing here is imported by ``import elastic``: a framework is imported only by its adapter.
"""
