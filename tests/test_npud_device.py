"""Device discovery on fixture trees: an amdxdna NPU with XRT, or the host and why."""

import glob
import os

import pytest

from npud.config import DeviceConfig
from npud.device import discover, gemm_site, other_holders


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


# -- where the GEMMs run, the firmware, other processes on the NPU --------------------------


def test_fw_version_comes_from_sysfs(tmp_path):
    info = discover(_tree(tmp_path), import_xrt=lambda: None)
    assert info.fw_version == "1.5.2.380" and info.to_wire()["fw_version"] == "1.5.2.380"
    other = tmp_path / "other"
    other.mkdir()
    assert discover(_tree(other, attrs={"vendor": "0x1022"}), import_xrt=lambda: None).fw_version is None


def _served(backend="xrt", placement=None, reason="r"):
    return {"name": "m", "backend": backend, "backend_reason": reason, "gemm_placement": placement or {}}


def test_gemm_site_says_npu_only_when_the_gemms_run_there(tmp_path):
    npu = discover(_tree(tmp_path), import_xrt=lambda: None)
    host_dev = discover(DeviceConfig(accel_dir=str(tmp_path / "none")), import_xrt=lambda: None)
    table = DeviceConfig(xrt_design="/etc/npud/designs/design.json")
    assert gemm_site(npu, DeviceConfig(backend="host", xrt_design="d.json"), []) == ("host", "device.backend = host")
    assert gemm_site(host_dev, table, []) == ("host", host_dev.reason)
    site, why = gemm_site(npu, DeviceConfig(), [])
    assert site == "host" and "no NPU GEMM design table" in why
    assert gemm_site(npu, table, [])[0] == "npu"
    assert gemm_site(npu, table, [_served("host", reason="host backend: no designs")]) == (
        "host", "model m: host backend: no designs")
    all_host = _served(placement={"64x64 fp32": "weight format fp32 runs on the host"})
    assert gemm_site(npu, table, [all_host]) == (
        "host", "no GEMM shape of the loaded models runs on the NPU (weight format fp32 runs on the host)")
    mixed = _served(placement={"64x64 bf16": "npu", "64x320 bf16": "no design for K=64, N=320",
                               "128x64 bf16": "npu-rowwise"})
    assert gemm_site(npu, table, [mixed]) == (
        "npu", "2 of 3 GEMM shapes on the NPU; the others on the host: no design for K=64, N=320")


def test_other_processes_with_the_npu_open_are_found(tmp_path):
    node = tmp_path / "accel0"
    node.write_text("")
    proc = tmp_path / "proc"
    for pid, comm, targets, fdinfo in ((100, "flm", [node], "drm-driver:\tamdxdna\ndrm-client-id:\t7\n"),
                                       (200, "bash", [tmp_path], ""), (300, "npud", [node], ""),
                                       (400, "xrt-smi", [node], None)):
        (proc / str(pid) / "fd").mkdir(parents=True)
        (proc / str(pid) / "fdinfo").mkdir()
        (proc / str(pid) / "comm").write_text(comm + "\n")
        for fd, target in enumerate(targets, 3):
            os.symlink(target, proc / str(pid) / "fd" / str(fd))
            if fdinfo is not None:
                (proc / str(pid) / "fdinfo" / str(fd)).write_text(fdinfo)
    holders = other_holders(str(node), str(proc), own_pid=300)
    assert holders == [{"pid": 100, "comm": "flm", "drm_client_ids": ["7"]},
                       {"pid": 400, "comm": "xrt-smi", "drm_client_ids": []}]
    assert other_holders(None, str(proc)) == [] and other_holders(str(tmp_path / "gone"), str(proc)) == []


@pytest.mark.npu
@pytest.mark.skipif(not glob.glob("/dev/accel/accel*"), reason="needs an NPU device node (/dev/accel/accel*)")
def test_npu_the_real_device_reports_its_firmware():
    info = discover(DeviceConfig(), import_xrt=lambda: None)
    assert info.driver == "amdxdna", info.reason
    assert info.fw_version, "sysfs has no fw_version for the amdxdna device"


# -- the NPU's power mode ([device] power_mode) ----------------------------------------------


def _npu(tmp_path):
    return discover(_tree(tmp_path), import_xrt=lambda: None)


def test_the_configured_power_mode_is_set_and_read_back(tmp_path):
    from npud.device import apply_power_mode

    state = {"mode": "default"}
    set_calls = []

    def set_mode(node, mode):
        set_calls.append((node, mode))
        state["mode"] = mode
        return True

    info = _npu(tmp_path)
    got = apply_power_mode(info, "performance", set_mode=set_mode, get_mode=lambda node: state["mode"])
    assert got == {"wanted": "performance", "current": "performance", "why": None}
    assert set_calls == [(info.node, "performance")]
    # "" leaves the driver's mode alone and reports it
    got = apply_power_mode(info, "", set_mode=set_mode, get_mode=lambda node: "turbo")
    assert got == {"wanted": None, "current": "turbo", "why": None} and len(set_calls) == 1


def test_a_daemon_without_cap_sys_admin_says_how_to_set_the_mode_and_goes_on(tmp_path):
    import errno

    import structlog

    from npud.device import apply_power_mode
    from npud.kernels.amdxdna import DriverRefused

    def refused(node, mode):
        raise DriverRefused(errno.EPERM, "Operation not permitted")

    with structlog.testing.capture_logs() as logs:
        got = apply_power_mode(_npu(tmp_path), "turbo", set_mode=refused, get_mode=lambda node: "default")
    assert got["wanted"] == "turbo" and got["current"] == "default"
    assert "CAP_SYS_ADMIN" in got["why"] and "sudo xrt-smi configure --pmode turbo" in got["why"]
    assert [e["event"] for e in logs] == ["npu_power_mode_refused"]


def test_the_power_mode_setting_takes_xrt_smi_s_names():
    from npud.config import DaemonConfigError

    assert DeviceConfig(power_mode="balanced").power_mode == "balanced"
    with pytest.raises(DaemonConfigError, match="device.power_mode"):
        DeviceConfig(power_mode="max")


def test_no_npu_no_power_mode(tmp_path):
    from npud.device import apply_power_mode

    info = discover(DeviceConfig(accel_dir=str(tmp_path / "none"), sysfs_class_dir=str(tmp_path)),
                    import_xrt=lambda: None)
    got = apply_power_mode(info, "turbo", set_mode=lambda *a: pytest.fail("set"), get_mode=lambda n: pytest.fail("get"))
    assert got == {"wanted": "turbo", "current": None, "why": info.reason}
