"""A local S3 endpoint (moto's server mode on 127.0.0.1) for tests and for trying the
s3:// paths by hand without a cloud account.

    python -m gpn_scale.testing.s3 --port 9000 --bucket data
    # prints the environment to export, then serves until Ctrl-C

In Python (the test suite's `s3_endpoint` fixture does this):

    with LocalS3() as s3:
        s3.create_bucket("data")
        os.environ.update(s3.env())   # S3_ENDPOINT_URL + dummy credentials

`LocalS3(process=True)` runs the server in a child process instead of a thread (useful
when the caller's process is busy, e.g. benchmarks); `enforce_auth=True` (implies a
process) makes the server reject unknown credentials, to test that error path.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from typing import Any

DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_until_listening(port: int, timeout: float, proc: subprocess.Popen | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"moto server exited with code {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"moto server did not listen on 127.0.0.1:{port} within {timeout:.0f}s")


class LocalS3:
    """moto S3 over real HTTP on 127.0.0.1:`port` (a free port by default)."""

    def __init__(
        self, port: int | None = None, *, process: bool = False, enforce_auth: bool = False
    ):
        self.port = port or free_port()
        self.process = process or enforce_auth
        self.enforce_auth = enforce_auth
        self._server: Any = None
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment that boto3 and streaming need to use this endpoint."""
        return {"S3_ENDPOINT_URL": self.url, **DUMMY_CREDENTIALS}

    def start(self, timeout: float = 30.0) -> LocalS3:
        if self.process:
            env = {**os.environ, **DUMMY_CREDENTIALS}
            if self.enforce_auth:
                # moto authenticates every request once this many have passed unchecked.
                env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        else:
            import logging

            from moto.server import ThreadedMotoServer

            # werkzeug logs every request at INFO; tests and benchmarks do not want that
            logging.getLogger("werkzeug").setLevel(logging.WARNING)

            self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
            self._server.start()
        _wait_until_listening(self.port, timeout, self._proc)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def client(self, **credentials: str) -> Any:
        import boto3

        creds = {**DUMMY_CREDENTIALS, **credentials}
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=creds["AWS_DEFAULT_REGION"],
            aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
        )

    def create_bucket(self, name: str) -> str:
        """Create `name` (if needed) and return 's3://name'."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return f"s3://{name}"

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def slow_down(operation: str) -> Exception:
    """The 503 SlowDown a throttling S3 answers."""
    from botocore.exceptions import ClientError

    return ClientError(
        {
            "Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
            "ResponseMetadata": {"HTTPStatusCode": 503},
        },
        operation,
    )


def checksum_mismatch(operation: str) -> Exception:
    """botocore's error for a body whose checksum does not match (a corrupted transfer)."""
    from botocore.exceptions import FlexibleChecksumError

    return FlexibleChecksumError(
        error_msg=f"Expected checksum abc= did not match calculated checksum xyz= ({operation})"
    )


def connection_reset(operation: str) -> Exception:
    return ConnectionResetError(104, f"Connection reset by peer ({operation})")


class S3Faults:
    """Deterministic S3 faults, in-process: while entered, a call of `operation` on `client`
    raises `error(operation)` before anything is sent whenever `when(n, params)` is true
    (`n`: the 1-based count of that operation's calls so far, `params`: its arguments, e.g.
    PartNumber). Counts are kept in `calls` and `injected`; no sleeps, no network tricks.

        with S3Faults(client).fail("UploadPart", slow_down, lambda n, p: n % 2 == 1) as faults:
            ...
        assert faults.injected["UploadPart"] == 4
    """

    def __init__(self, client: Any) -> None:
        import threading
        from collections import Counter

        self.client = client
        self.calls: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self._rules: list[tuple[str, Any, Any]] = []
        self._lock = threading.Lock()
        self._id = f"gpn-s3-faults-{id(self)}"

    def fail(self, operation: str, error: Any, when: Any) -> S3Faults:
        self._rules.append((operation, error, when))
        return self

    def _hook(self, model: Any, params: Any, **_: Any) -> None:
        name = model.name
        with self._lock:
            self.calls[name] += 1
            n = self.calls[name]
            rule = next((r for r in self._rules if r[0] == name and r[2](n, params)), None)
            if rule is not None:
                self.injected[name] += 1
        if rule is not None:
            raise rule[1](name)

    def __enter__(self) -> S3Faults:
        self.client.meta.events.register(
            "before-parameter-build.s3", self._hook, unique_id=self._id
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.meta.events.unregister("before-parameter-build.s3", unique_id=self._id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpn_scale.testing.s3",
        description="Serve a local S3 endpoint (moto) on 127.0.0.1 until interrupted.",
    )
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument(
        "--bucket", action="append", default=[], help="create this bucket at start (repeatable)"
    )
    args = parser.parse_args(argv)
    with LocalS3(args.port) as s3:
        for bucket in args.bucket:
            s3.create_bucket(bucket)
        print("local S3 endpoint is up; in another shell:")
        for key, value in s3.env().items():
            print(f"  export {key}={value}")
        if args.bucket:
            print("buckets: " + ", ".join(f"s3://{b}" for b in args.bucket))
        sys.stdout.flush()
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
