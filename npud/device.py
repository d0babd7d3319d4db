"""Which compute device npud drives: an amdxdna NPU with the XRT binding, or else the host CPU.

Discovery looks at the accel device nodes, the driver bound to each in sysfs, and whether
`pyxrt` imports; the answer carries the reason so `npuctl device` can say why.
"""

from __future__ import annotations

import glob
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from npud.config import DeviceConfig

DRIVER = "amdxdna"
# PCI attributes every device has, and those the amdxdna driver adds where it has them
SYSFS_ATTRS = ("vendor", "device", "revision", "subsystem_vendor", "subsystem_device", "numa_node",
               "vbnv", "device_type", "fw_version")


@dataclass(slots=True, frozen=True)
class DeviceInfo:
    kind: str  # "npu" or "host"
    reason: str
    nodes: tuple[str, ...] = ()
    node: str | None = None  # the amdxdna node used
    driver: str | None = None
    sysfs: dict = field(default_factory=dict)
    xrt: bool = False

    def to_wire(self) -> dict:
        return {"kind": self.kind, "reason": self.reason, "nodes": list(self.nodes), "node": self.node,
                "driver": self.driver, "sysfs": dict(self.sysfs), "xrt": self.xrt}


def _read_attrs(device_dir: Path) -> dict:
    attrs = {}
    for name in SYSFS_ATTRS:
        try:
            attrs[name] = (device_dir / name).read_text(errors="replace").strip()
        except OSError:
            continue
    return attrs


def _driver_of(device_dir: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(device_dir / "driver"))
    except OSError:
        return None


def _import_xrt() -> str | None:
    """None if pyxrt imports, else why not."""
    try:
        importlib.import_module("pyxrt")
    except Exception as exc:  # an XRT install can fail in many ways (ImportError, OSError from its .so)
        return f"{type(exc).__name__}: {exc}"
    return None


def discover(cfg: DeviceConfig, *, import_xrt: Callable[[], str | None] = _import_xrt) -> DeviceInfo:
    """Find the device to report and drive; never raises."""
    nodes = tuple(sorted(glob.glob(os.path.join(cfg.accel_dir, "accel*"))))
    if not nodes:
        return DeviceInfo("host", f"no {cfg.accel_dir}/accel* node: no NPU, or the {DRIVER} driver is not loaded")
    found = []
    for node in nodes:
        device_dir = Path(cfg.sysfs_class_dir) / os.path.basename(node) / "device"
        found.append((node, _driver_of(device_dir), _read_attrs(device_dir)))
    ours = [(n, d, a) for n, d, a in found if d == DRIVER]
    if not ours:
        drivers = ", ".join(f"{n}: {d or 'unknown driver'}" for n, d, _ in found)
        return DeviceInfo("host", f"no accel node is driven by {DRIVER} ({drivers})", nodes,
                          driver=found[0][1], sysfs=found[0][2])
    node, driver, attrs = ours[0]
    if not os.access(node, os.R_OK | os.W_OK):
        return DeviceInfo("host", f"{node} ({DRIVER}) is not readable and writable by this user "
                                  "(add it to the device's group, usually 'render')", nodes, node, driver, attrs)
    xrt_error = import_xrt()
    if xrt_error is not None:
        return DeviceInfo("host", f"{DRIVER} device at {node}, but the XRT binding pyxrt does not import "
                                  f"({xrt_error}); install XRT", nodes, node, driver, attrs)
    fw = f", firmware {attrs['fw_version']}" if "fw_version" in attrs else ""
    return DeviceInfo("npu", f"{DRIVER} device at {node}{fw}, pyxrt imports", nodes, node, driver, attrs, True)
