"""API routers: jobs, nodes, system (health, readiness, metrics)."""
