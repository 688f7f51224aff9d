"""The controller: leader election, the reconcile loop, and its pure decisions (reconcile, recovery,
scheduling)."""
