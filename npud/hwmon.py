"""The hwmon sensors the thermal guard prefers: the NPU's own, then the package's.

Kernels where amdxdna works with AMD PMF register a hwmon device named "amdxdna" whose
labels are NPU_temperature and NPU_power; k10temp's Tctl is the Ryzen package control
temperature. hwmon files hold millidegrees C (temp*_input) and microwatts (power*_input,
or power*_average where a driver only averages).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class HwmonSensors:
    npu_temp_c: float | None = None
    npu_power_w: float | None = None
    tctl_c: float | None = None


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _labelled(device_dir: str, kind: str, label: str, suffixes: tuple[str, ...]) -> int | None:
    """The value of the `kind`*_input (or other suffix) whose `kind`*_label reads `label`."""
    for label_path in sorted(glob.glob(os.path.join(device_dir, f"{kind}*_label"))):
        try:
            with open(label_path, encoding="ascii") as f:
                if f.read().strip() != label:
                    continue
        except (OSError, UnicodeDecodeError):
            continue
        stem = label_path[: -len("_label")]
        for suffix in suffixes:
            value = _read_int(f"{stem}_{suffix}")
            if value is not None:
                return value
    return None


def read_hwmon(root: str = "/sys/class/hwmon") -> HwmonSensors:
    """The NPU temperature and power and the package Tctl found under `root` (None where absent)."""
    npu_temp = npu_power = tctl = None
    for device_dir in sorted(glob.glob(os.path.join(root, "hwmon*"))):
        try:
            with open(os.path.join(device_dir, "name"), encoding="ascii") as f:
                name = f.read().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if name == "amdxdna":
            milli = _labelled(device_dir, "temp", "NPU_temperature", ("input",))
            micro = _labelled(device_dir, "power", "NPU_power", ("input", "average"))
            npu_temp = npu_temp if milli is None else milli / 1000.0
            npu_power = npu_power if micro is None else micro / 1e6
        elif name == "k10temp" and tctl is None:
            milli = _labelled(device_dir, "temp", "Tctl", ("input",))
            tctl = None if milli is None else milli / 1000.0
    return HwmonSensors(npu_temp, npu_power, tctl)
