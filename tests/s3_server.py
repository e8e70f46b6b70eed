"""A real S3-compatible server for tests: moto's ``moto_server`` on 127.0.0.1, on a free port.

Started as its own process (the ``test`` extra installs ``moto[server]``), reached through ``s3fs``
exactly as users reach AWS: the endpoint from ``AWS_ENDPOINT_URL``. No client library is mocked.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

__all__ = ["CREDENTIALS", "MotoServer", "apply", "authenticating_server", "environment", "make_bucket"]

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """``moto_server`` in a child process; :meth:`stop` ends it (and waits)."""

    def __init__(self, timeout_s: float = 60.0, *, env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not start on port {self.port}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


def environment(endpoint: str) -> dict[str, str]:
    """The variables a user sets to reach this server (and a real bucket the same way)."""
    return {"AWS_ENDPOINT_URL": endpoint, **CREDENTIALS}


def make_bucket(endpoint: str, env: dict[str, str] | None = None) -> str:
    """A new, empty bucket (made with the credentials of ``env``, default :data:`CREDENTIALS`); its name."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=endpoint, **_boto_credentials(env))
    client.create_bucket(Bucket=name)
    return name


def _boto_credentials(env: dict[str, str] | None = None) -> dict[str, str]:
    env = env or CREDENTIALS
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


def apply(env: dict[str, str]) -> None:
    """Set ``env`` in this process (a rank started by the fork server does not see the test's monkeypatch)."""
    os.environ.update(env)


def authenticating_server() -> tuple[MotoServer, dict[str, str]]:
    """A server that checks credentials (moto's IAM), and the variables of a user allowed to use S3.

    moto answers the first 3 requests without checking (``INITIAL_NO_AUTH_ACTION_COUNT``): they make the user.
    """
    import boto3

    server = MotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"})
    iam = boto3.client("iam", endpoint_url=server.endpoint, **_boto_credentials())
    iam.create_user(UserName="trainer")
    policy = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'
    iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=policy)
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    env = {**environment(server.endpoint), "AWS_ACCESS_KEY_ID": key["AccessKeyId"]}
    env["AWS_SECRET_ACCESS_KEY"] = key["SecretAccessKey"]
    return server, env
