"""A whole service on one machine (real etcd, controller and agents as processes): the demo and the tests
run the same harness."""
