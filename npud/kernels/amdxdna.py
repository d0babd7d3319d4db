"""What the amdxdna driver says about the NPU as a whole, asked by ioctl on its accel node.

Standard library only (fcntl, ctypes): the daemon reads and sets the power mode with it, the
NPU worker asks how many hardware contexts the device has left. Both drivers (in-kernel
drivers/accel/amdxdna and amd/xdna-driver) number these the same way (their uapi headers,
amdxdna_accel.h):

- DRM_IOCTL_AMDXDNA_GET_INFO (command 7) with a `struct amdxdna_drm_get_info` {u32 param,
  u32 buffer_size, u64 buffer}: param 12 (DRM_AMDXDNA_QUERY_RESOURCE_INFO) fills
  `struct amdxdna_drm_get_resource_info` {u64 npu_clk_max, npu_tops_max, npu_task_max,
  npu_tops_curr, npu_task_curr}, where npu_task_max is the device's hardware-context limit
  (hwctx_limit: 6 on npu1, 16 on npu4/5/6) and npu_task_curr the contexts every process holds
  now; param 9 (DRM_AMDXDNA_GET_POWER_MODE) fills {u8 power_mode, u8 pad[7]}. Any process that
  may open the node may ask. A driver without a query answers EINVAL or EOPNOTSUPP and logs
  "Not supported request parameter N" (a benign line, npud/guards.py).
- DRM_IOCTL_AMDXDNA_SET_STATE (command 8), same layout: param 0 (DRM_AMDXDNA_SET_POWER_MODE)
  with {u8 power_mode, u8 pad[7]}. The driver registers this ioctl DRM_ROOT_ONLY: it needs
  CAP_SYS_ADMIN, so a daemon running as its own user gets EACCES/EPERM (`sudo xrt-smi
  configure --pmode MODE` sets the same).

The power modes are the driver's enum amdxdna_power_mode_type (DEFAULT, LOW, MEDIUM, HIGH,
TURBO), named as xrt-smi's --pmode names them: default (the driver picks the clock from the
contexts' QoS), powersaver (lowest DPM level), balanced (half the top level), performance (top
level) and turbo (top level, clock gating off).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

DRM_COMMAND_BASE = 0x40
_GET_INFO, _SET_STATE = 7, 8
QUERY_RESOURCE_INFO, GET_POWER_MODE = 12, 9
SET_POWER_MODE = 0
POWER_MODES = {"default": 0, "powersaver": 1, "balanced": 2, "performance": 3, "turbo": 4}
_ARGS = struct.Struct("<IIQ")  # param, buffer_size, buffer (a user pointer)
_RESOURCE_INFO = struct.Struct("<5Q")
_POWER_MODE = struct.Struct("<B7x")
UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTTY)


def _iowr(command: int, size: int) -> int:
    """DRM_IOWR(DRM_COMMAND_BASE + command, a struct of `size` bytes): _IOC(READ|WRITE, 'd', nr, size)."""
    return (3 << 30) | (size << 16) | (ord("d") << 8) | (DRM_COMMAND_BASE + command)


GET_INFO_REQUEST = _iowr(_GET_INFO, _ARGS.size)
SET_STATE_REQUEST = _iowr(_SET_STATE, _ARGS.size)

Ioctl = Callable[[int, int, bytearray], object]  # fcntl.ioctl's (fd, request, mutable buffer) form


class DriverRefused(OSError):
    """The driver refused the request (its errno says why: EPERM/EACCES for a set that needs
    CAP_SYS_ADMIN)."""


@dataclass(slots=True, frozen=True)
class ResourceInfo:
    contexts_limit: int  # the device's hardware contexts (hwctx_limit)
    contexts_in_use: int  # held now, by every process


def _call(node: str, request: int, param: int, buffer: ctypes.Array, ioctl: Ioctl) -> bool:
    """One GET_INFO / SET_STATE on `node`; False when the driver has no such parameter.
    Raises DriverRefused for any other errno, OSError when the node does not open."""
    args = bytearray(_ARGS.pack(param, ctypes.sizeof(buffer), ctypes.addressof(buffer)))
    fd = os.open(node, os.O_RDWR | os.O_CLOEXEC)
    try:
        ioctl(fd, request, args)
    except OSError as exc:
        if exc.errno in UNSUPPORTED:
            return False
        raise DriverRefused(exc.errno, f"amdxdna refused ioctl 0x{request:08x} param {param}: {exc.strerror}") from None
    finally:
        os.close(fd)
    return True


def resource_info(node: str, ioctl: Ioctl = fcntl.ioctl) -> ResourceInfo | None:
    """The device's context limit and the contexts all processes hold, or None where the driver
    does not say (no such query, no such node). Raises DriverRefused."""
    buffer = ctypes.create_string_buffer(_RESOURCE_INFO.size)
    try:
        if not _call(node, GET_INFO_REQUEST, QUERY_RESOURCE_INFO, buffer, ioctl):
            return None
    except DriverRefused:
        raise
    except OSError:
        return None
    _, _, task_max, _, task_curr = _RESOURCE_INFO.unpack(buffer.raw)
    return ResourceInfo(int(task_max), int(task_curr))


def power_mode(node: str, ioctl: Ioctl = fcntl.ioctl) -> str | None:
    """The device's power mode (a POWER_MODES name), or None where the driver does not say.
    Raises DriverRefused, OSError when the node does not open."""
    buffer = ctypes.create_string_buffer(_POWER_MODE.size)
    if not _call(node, GET_INFO_REQUEST, GET_POWER_MODE, buffer, ioctl):
        return None
    (value,) = _POWER_MODE.unpack(buffer.raw)
    return next((name for name, v in POWER_MODES.items() if v == value), f"unknown ({value})")


def set_power_mode(node: str, mode: str, ioctl: Ioctl = fcntl.ioctl) -> bool:
    """Set the device's power mode; False when the driver has no power modes. Raises ValueError
    for an unknown mode, DriverRefused (EPERM/EACCES without CAP_SYS_ADMIN), OSError."""
    if mode not in POWER_MODES:
        raise ValueError(f"power mode {mode!r}: expected one of {list(POWER_MODES)}")
    buffer = ctypes.create_string_buffer(_POWER_MODE.pack(POWER_MODES[mode]), _POWER_MODE.size)
    return _call(node, SET_STATE_REQUEST, SET_POWER_MODE, buffer, ioctl)
