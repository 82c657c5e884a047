"""cuda_ext on a machine without a GPU: clean import, quiet fallback, CPU engine path."""

import subprocess
import sys

import pytest
import torch

import cuda_ext

needs_gpu = pytest.mark.skipif(not cuda_ext.available(), reason="needs a CUDA GPU, driver and cuda-python")


def test_import_is_clean_and_reports_unavailable_quietly():
    code = ("import warnings, logging; warnings.simplefilter('error'); "
            "import cuda_ext, dcp_datastates; print(cuda_ext.available(), '|', cuda_ext.unavailable_reason())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if not torch.cuda.is_available():
        avail, reason = out.stdout.strip().split(" | ")
        assert avail == "False" and reason
        assert out.stderr.strip() == ""  # no warnings flood


def test_import_without_cuda_python():
    code = ("import sys; sys.modules['cuda'] = None; import cuda_ext; "
            "print(cuda_ext.available(), cuda_ext._runtime())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["False", "None"]


def test_check_raises_with_name():
    class FakeErr(int):
        pass
    with pytest.raises(cuda_ext.CudaError, match="thing failed"):
        cuda_ext.check((FakeErr(35),), "thing")
    assert cuda_ext.check((0, 7), "x") == 7


@needs_gpu
def test_gpu_roundtrip_bit_exact(tmp_path):
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader, DataStatesWriter
    sd = {"a": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(77, device="cuda").bfloat16()}
    dcp.save(sd, storage_writer=DataStatesWriter(str(tmp_path)), no_dist=True)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=DataStatesReader(str(tmp_path)), no_dist=True)
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_bindings_without_driver_fall_back():
    """cuda-python installed (the test extra) but no driver: available() is False, no exception."""
    code = ("import torch; torch.cuda.is_available = lambda: True; import cuda_ext; "
            "rt = cuda_ext._runtime(); print(rt is not None, cuda_ext.available(), '|', cuda_ext.unavailable_reason())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if torch.cuda.is_available() or not out.stdout.startswith("True"):
        pytest.skip("needs cuda-python installed on a machine without a GPU")
    head, reason = out.stdout.strip().split(" | ")
    assert head == "True False" and reason
