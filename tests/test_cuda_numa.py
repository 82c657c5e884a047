"""The NUMA hint for pinned memory (``cuda_ext``), checked without a GPU: the PCI address the
CUDA runtime gives is turned into the sysfs name of the device, and that device's node into
CPUs.  On an H200 with torch 2.11 the address came back as an int (``pci_bus_id`` of torch's
device properties is the bus number) and pinning failed; a hint must never fail pinning."""

from __future__ import annotations

import pytest

import cuda_ext


@pytest.mark.parametrize("raw, want", [
    (b"0000:1A:00.0\x00\x00\x00", "0000:1a:00.0"),
    ("00000000:9B:00.0", "0000:9b:00.0"),
    ("0001:04:00.0", "0001:04:00.0"),
])
def test_the_runtime_pci_address_becomes_the_sysfs_name(raw, want):
    assert cuda_ext._sysfs_pci_name(raw) == want


@pytest.mark.parametrize("raw", [27, None, b"", "garbage"])
def test_an_address_that_is_not_one_gives_no_hint(raw):
    with pytest.raises(ValueError):
        cuda_ext._sysfs_pci_name(raw)


def test_cpus_of_the_device_node_come_from_sysfs(tmp_path):
    (tmp_path / "bus/pci/devices/0000:1a:00.0").mkdir(parents=True)
    (tmp_path / "bus/pci/devices/0000:1a:00.0/numa_node").write_text("1\n")
    (tmp_path / "devices/system/node/node1").mkdir(parents=True)
    (tmp_path / "devices/system/node/node1/cpulist").write_text("8-11,24\n")
    assert cuda_ext._cpus_of_pci_device("0000:1a:00.0", str(tmp_path)) == {8, 9, 10, 11, 24}
    (tmp_path / "bus/pci/devices/0000:1a:00.0/numa_node").write_text("-1\n")
    assert cuda_ext._cpus_of_pci_device("0000:1a:00.0", str(tmp_path)) is None
    assert cuda_ext._cpus_of_pci_device("0000:ff:00.0", str(tmp_path)) is None
