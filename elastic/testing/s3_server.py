"""A real S3-compatible server on loopback (moto in server mode, in its own process) for tests and benches.

Needs the ``moto[server]`` package (a ``dev`` extra); nothing is imported from it here, the server runs as
``python -m moto.server``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from elastic.testing.ports import free_port

__all__ = ["LocalS3Server"]

logger = logging.getLogger(__name__)


class LocalS3Server:
    """``python -m moto.server`` on a loopback ``host`` and a free port; ``start()`` waits for it."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, log_path: Path | None = None) -> None:
        if not host.startswith("127."):
            raise ValueError("the local S3 server only binds loopback addresses (127.0.0.0/8)")
        self.host = host
        self.port = port or free_port(host)
        self._log_path = log_path
        self._log: IO[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def storage_options(self, key: str = "testing", secret: str = "testing") -> dict[str, Any]:
        """fsspec/s3fs options that reach this server with dummy credentials."""
        return {
            "key": key,
            "secret": secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url},
        }

    def start(self, timeout: timedelta = timedelta(seconds=60)) -> LocalS3Server:
        out: Any = subprocess.DEVNULL
        if self._log_path is not None:
            self._log = open(self._log_path, "ab")
            out = self._log
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout.total_seconds()
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self._proc.returncode} (log: {self._log_path})")
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=2):
                    logger.info("S3 (moto) server ready at %s", self.endpoint_url)
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"moto server at {self.endpoint_url} did not answer within {timeout}")

    def create_bucket(self, name: str) -> None:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options()).mkdir(name)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
