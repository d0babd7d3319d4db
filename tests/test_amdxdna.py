"""The amdxdna driver's queries by ioctl (npud/kernels/amdxdna.py) against a fake ioctl that
answers as the driver's uapi header lays the structs out: the request numbers, the argument
struct, the buffer the driver fills or reads, and what each errno means."""

from __future__ import annotations

import ctypes
import errno
import struct

import pytest

from npud.kernels import amdxdna


class FakeDriver:
    """Answers GET_INFO and SET_STATE the way amdxdna does (its uapi: {u32 param, u32 buffer_size,
    u64 buffer} pointing at the param's struct)."""

    def __init__(self, *, limit=6, in_use=2, mode=0, refuse_set: int | None = None, params=(9, 12)):
        self.limit, self.in_use, self.mode, self.refuse_set, self.params = limit, in_use, mode, refuse_set, params
        self.calls = []

    def __call__(self, fd, request, args):
        param, size, pointer = struct.unpack("<IIQ", bytes(args))
        self.calls.append((request, param, size))
        if request == amdxdna.GET_INFO_REQUEST:
            if param not in self.params:
                raise OSError(errno.EOPNOTSUPP, "Operation not supported")
            data = (struct.pack("<5Q", 1800, 50, self.limit, 10, self.in_use) if param == 12
                    else struct.pack("<B7x", self.mode))
            assert size == len(data)
            ctypes.memmove(pointer, data, size)
        elif request == amdxdna.SET_STATE_REQUEST:
            if self.refuse_set is not None:
                raise OSError(self.refuse_set, "Permission denied")
            assert (param, size) == (0, 8)
            self.mode = ctypes.string_at(pointer, size)[0]
        else:
            raise OSError(errno.ENOTTY, "Inappropriate ioctl for device")


@pytest.fixture
def node(tmp_path):
    path = tmp_path / "accel0"
    path.write_bytes(b"")  # opened O_RDWR, then handed to the fake ioctl
    return str(path)


def test_the_request_numbers_are_drm_iowr_of_the_drivers_commands():
    # DRM_IOWR(DRM_COMMAND_BASE + 7 / + 8, 16-byte struct): _IOC(3, 'd', 0x47 / 0x48, 16)
    assert amdxdna.GET_INFO_REQUEST == 0xC0106447
    assert amdxdna.SET_STATE_REQUEST == 0xC0106448


def test_resource_info_reads_the_limit_and_every_process_s_contexts(node):
    driver = FakeDriver(limit=16, in_use=5)
    assert amdxdna.resource_info(node, driver) == amdxdna.ResourceInfo(16, 5)
    assert driver.calls == [(amdxdna.GET_INFO_REQUEST, 12, 40)]


def test_a_driver_without_the_query_says_nothing(node, tmp_path):
    assert amdxdna.resource_info(node, FakeDriver(params=())) is None
    assert amdxdna.power_mode(node, FakeDriver(params=())) is None
    assert amdxdna.resource_info(str(tmp_path / "no-such-node")) is None


def test_power_modes_are_read_and_set_by_xrt_smi_s_names(node):
    driver = FakeDriver(mode=0)
    assert amdxdna.power_mode(node, driver) == "default"
    assert amdxdna.set_power_mode(node, "performance", driver) is True
    assert driver.mode == 3 and amdxdna.power_mode(node, driver) == "performance"
    with pytest.raises(ValueError, match="expected one of"):
        amdxdna.set_power_mode(node, "fast", driver)


@pytest.mark.parametrize("code", [errno.EPERM, errno.EACCES])
def test_setting_the_mode_without_cap_sys_admin_is_refused(node, code):
    with pytest.raises(amdxdna.DriverRefused) as refused:
        amdxdna.set_power_mode(node, "turbo", FakeDriver(refuse_set=code))
    assert refused.value.errno == code
