"""A real S3 server for tests: moto in server mode on 127.0.0.1, configured through the
standard AWS environment only (as a user's would be). Used by the `s3` fixture (conftest)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SECRET = "kldiag-test-secret-4f9a"  # must never appear in run.json, logs or errors
ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


@dataclass
class S3:
    endpoint: str
    server: object

    def bucket(self, prefix: str = "kld") -> str:
        """A new, empty bucket; returns its name."""
        import boto3

        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str) -> list[str]:
        import boto3

        out = boto3.client("s3", endpoint_url=self.endpoint).list_objects_v2(Bucket=bucket)
        return sorted(o["Key"] for o in out.get("Contents", []))


@contextmanager
def moto_s3() -> Iterator[S3]:
    """Start moto's S3 server on a free loopback port, set the AWS environment, stop it after."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    os.environ.update(AWS_ACCESS_KEY_ID="kldiag-test-key", AWS_SECRET_ACCESS_KEY=SECRET,
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://{host}:{port}")
    try:
        yield S3(f"http://{host}:{port}", server)
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
