"""The job service: REST controller on etcd, node agents that run torchrun, CLI."""
