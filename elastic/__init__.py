"""Elastic, fault-tolerant training for stock torchrun: etcd v3 rendezvous, checkpoints, elastic loop."""

__version__ = "0.1.0"
