"""Every Python code sample in README.md and docs/ runs, and runs again.

Each ```python block runs as pasted, in a fresh namespace, twice (a user reruns an example).  Absolute example paths (``/ckpt/``,
``/local_nvme/``, ``/lustre/``) are mapped into a temp directory, ``s3://bucket/`` onto a real S3
server on 127.0.0.1, and a sample's ``s3_options = ...`` line onto that server's options."""

from __future__ import annotations

import glob
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _samples():
    out = []
    for f in FILES:
        text = open(f).read()
        for i, m in enumerate(re.finditer(r"```python\n(.*?)```", text, re.S)):
            out.append(pytest.param(f, m.group(1), id=f"{os.path.basename(f)}#{i}"))
    return out


SAMPLES = _samples()


def test_docs_have_samples():
    assert len(SAMPLES) >= 5


@pytest.mark.parametrize("path,code", SAMPLES)
def test_sample_runs(path, code, tmp_path, s3):
    """Each sample runs as pasted, in a fresh namespace that provides nothing, and again in
    another (what the first run left must not stop the second): only its example paths are
    mapped into a temp directory and onto a real S3 server on 127.0.0.1."""
    from dcp_datastates.providers import unregister_provider
    from dcp_datastates.providers.registry import _by_type
    bucket = s3.make_bucket(f"docs-{abs(hash((path, code))) % 10**8}")
    code = (code.replace("/ckpt/", f"{tmp_path}/ckpt/").replace("/local_nvme/", f"{tmp_path}/nvme/")
            .replace("/lustre/", f"{tmp_path}/lustre/").replace("s3://bucket/", f"{bucket}/"))
    code = re.sub(r"^s3_options = .*$", f"s3_options = {s3.options()!r}", code, flags=re.M)
    before = set(_by_type)
    try:
        for _run in range(2):
            for cls in set(_by_type) - before:  # a rerun registers its providers again
                unregister_provider(cls)
            exec(compile(code, f"{os.path.basename(path)} sample", "exec"), {"__name__": "__docs__"})
    finally:
        for cls in set(_by_type) - before:  # samples may register providers
            unregister_provider(cls)
