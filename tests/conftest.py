import logging

import pytest


@pytest.fixture(autouse=True)
def _quiet_logs(caplog):
    caplog.set_level(logging.WARNING)
    yield


@pytest.fixture(scope="session")
def s3():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from tests.s3server import S3Server
    server = S3Server().start()
    yield server
    server.stop()
