"""Device discovery on fixture trees: an amdxdna NPU with XRT, or the host and why."""

import os

from npud.config import DeviceConfig
from npud.device import discover


def _tree(tmp_path, driver="amdxdna", attrs=None):
    accel = tmp_path / "dev" / "accel"
    accel.mkdir(parents=True)
    (accel / "accel0").write_text("")
    device = tmp_path / "sys" / "accel0" / "device"
    device.mkdir(parents=True)
    drivers = tmp_path / "drivers" / driver
    drivers.mkdir(parents=True)
    os.symlink(drivers, device / "driver")
    for name, value in (attrs or {"vendor": "0x1022", "device": "0x17f0", "fw_version": "1.5.2.380"}).items():
        (device / name).write_text(value + "\n")
    return DeviceConfig(accel_dir=str(accel), sysfs_class_dir=str(tmp_path / "sys"))


def test_npu_when_node_driver_and_xrt_are_there(tmp_path):
    info = discover(_tree(tmp_path), import_xrt=lambda: None)
    assert info.kind == "npu" and info.driver == "amdxdna" and info.xrt
    assert info.node.endswith("accel0") and info.sysfs["device"] == "0x17f0"
    assert "1.5.2.380" in info.reason


def test_host_when_xrt_does_not_import(tmp_path):
    info = discover(_tree(tmp_path), import_xrt=lambda: "ModuleNotFoundError: No module named 'pyxrt'")
    assert info.kind == "host" and "pyxrt" in info.reason and "install XRT" in info.reason
    assert info.driver == "amdxdna"


def test_host_when_the_node_has_another_driver(tmp_path):
    info = discover(_tree(tmp_path, driver="ivpu"), import_xrt=lambda: None)
    assert info.kind == "host" and "ivpu" in info.reason


def test_host_when_there_is_no_node(tmp_path):
    info = discover(DeviceConfig(accel_dir=str(tmp_path / "none"), sysfs_class_dir=str(tmp_path)),
                    import_xrt=lambda: None)
    assert info.kind == "host" and "no " in info.reason and info.nodes == ()


def test_real_import_of_pyxrt_reports_its_error(tmp_path):
    info = discover(_tree(tmp_path))
    try:
        import pyxrt  # noqa: F401
    except Exception:
        assert info.kind == "host" and "pyxrt" in info.reason
    else:
        assert info.kind == "npu"
