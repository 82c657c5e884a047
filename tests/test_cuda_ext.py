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


@needs_gpu
@pytest.mark.parametrize("device_cache", [0, 64 << 20])
def test_gpu_async_through_the_device_cache_and_loads_onto_the_gpu(tmp_path, device_cache):
    """Async save with the device cache on and off (host cache smaller than the state), then
    loads onto the GPU: whole tensors (streamed through pinned slabs), a cast and a
    non-contiguous destination (cut out on the device)."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader, DataStatesWriter
    from dcp_datastates.engine import upload
    g = torch.Generator(device="cuda").manual_seed(1)
    sd = {"f32": torch.randn(4096, 1024, generator=g, device="cuda"),
          "bf16": torch.randn(3 << 20, generator=g, device="cuda").bfloat16(),
          "i8": torch.randint(-128, 127, (5 << 20,), dtype=torch.int8, generator=g, device="cuda"),
          "nc": torch.randn(2048, 1024, generator=g, device="cuda").t()}
    want = {k: v.clone() for k, v in sd.items()}
    w = DataStatesWriter(str(tmp_path), host_cache_bytes=4 << 20, device_cache_bytes=device_cache)
    fut = dcp.async_save(sd, storage_writer=w)
    assert w.wait_snapshot(timeout=60)
    for v in sd.values():
        v.add_(1)
    fut.result()
    out = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(out, storage_reader=DataStatesReader(str(tmp_path)), no_dist=True)
    assert all(torch.equal(out[k], want[k]) for k in want)
    assert upload._slabs  # the load went through pinned slabs
    cast = {"f32": torch.zeros(4096, 1024, dtype=torch.float64, device="cuda")}
    dcp.load(cast, storage_reader=DataStatesReader(str(tmp_path)), no_dist=True)
    assert torch.equal(cast["f32"], want["f32"].double())
    nc = {"nc": torch.zeros(1024, 2048, device="cuda").t()}
    dcp.load(nc, storage_reader=DataStatesReader(str(tmp_path)), no_dist=True)
    assert torch.equal(nc["nc"], want["nc"])
