"""etcd v3 rendezvous for torchrun: backend, store and the ``etcd-v3`` handler plugin."""
