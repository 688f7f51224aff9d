"""The example scripts and their plain-DDP twins (examples/): how much the elastic one changes, and how it trains
under real torchrun on etcd-v3 through kills and resizes."""
