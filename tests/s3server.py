"""A real S3-protocol server (moto's standalone server) on 127.0.0.1, as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

from tests.dist import free_port


class S3Server:
    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> "S3Server":
        env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                      "-p", str(self.port)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1)
                return self
            except Exception:
                if self.proc.poll() is not None:
                    raise RuntimeError("moto server exited at start")
                time.sleep(0.2)
        raise RuntimeError("moto server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def options(self, block_size: int = 5 << 20) -> dict:
        # small blocks so that test-sized files take the multipart path
        return {"key": "testing", "secret": "testing", "default_block_size": block_size,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
                "skip_instance_cache": True}

    def make_bucket(self, name: str) -> str:
        import boto3
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=name)
        return f"s3://{name}"
