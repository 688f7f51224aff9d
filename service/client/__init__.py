"""The REST client of the job service (what the ``etrain`` CLI, the demo and the tests' local cluster use)."""

from service.client.rest import ApiClient, ApiError, load_job_file

__all__ = ["ApiClient", "ApiError", "load_job_file"]
