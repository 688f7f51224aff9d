"""What every plane of the service shares: the job models, the life cycle, settings, the state in etcd and the
controller's view of it."""
