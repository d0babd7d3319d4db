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


class SensorFiles:
    """Sensor files held open and read with pread: a guard keeps reading when clients have
    taken every descriptor the process may open. A file replaced on disk (another inode at
    the path) is opened again; os.stat needs no descriptor."""

    def __init__(self) -> None:
        self._open: dict[str, int] = {}

    def read_int(self, path: str) -> int | None:
        """The integer the file holds, or None (missing, unreadable, not an integer)."""
        fd = self._open.get(path)
        if fd is not None:
            try:
                now, held = os.stat(path), os.fstat(fd)
                if (now.st_ino, now.st_dev) != (held.st_ino, held.st_dev):
                    self._drop(path)
                    fd = None
            except OSError:
                self._drop(path)
                return None
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
            self._open[path] = fd
        try:
            return int(os.pread(fd, 64, 0).decode("ascii").strip())
        except (OSError, ValueError, UnicodeDecodeError):
            return None

    def _drop(self, path: str) -> None:
        fd = self._open.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for path in list(self._open):
            self._drop(path)


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _labelled(device_dir: str, kind: str, label: str, suffixes: tuple[str, ...]) -> str | None:
    """The path of the readable `kind`*_input (or other suffix) whose `kind`*_label reads `label`."""
    for label_path in sorted(glob.glob(os.path.join(device_dir, f"{kind}*_label"))):
        try:
            with open(label_path, encoding="ascii") as f:
                if f.read().strip() != label:
                    continue
        except (OSError, UnicodeDecodeError):
            continue
        stem = label_path[: -len("_label")]
        for suffix in suffixes:
            if _read_int(f"{stem}_{suffix}") is not None:
                return f"{stem}_{suffix}"
    return None


def find_hwmon(root: str = "/sys/class/hwmon") -> dict[str, str]:
    """The sensor files under `root`: "npu_temp", "npu_power" and "tctl" to their paths, where present."""
    found: dict[str, str] = {}
    for device_dir in sorted(glob.glob(os.path.join(root, "hwmon*"))):
        try:
            with open(os.path.join(device_dir, "name"), encoding="ascii") as f:
                name = f.read().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if name == "amdxdna":
            for key, kind, label, suffixes in (("npu_temp", "temp", "NPU_temperature", ("input",)),
                                               ("npu_power", "power", "NPU_power", ("input", "average"))):
                path = _labelled(device_dir, kind, label, suffixes)
                if path is not None:
                    found[key] = path
        elif name == "k10temp" and "tctl" not in found:
            path = _labelled(device_dir, "temp", "Tctl", ("input",))
            if path is not None:
                found["tctl"] = path
    return found


class HwmonReader:
    """The hwmon sensors under `root`, found once and then read through held files; found
    again after a read fails (a driver reloaded, a device renumbered)."""

    def __init__(self, root: str, files: SensorFiles) -> None:
        self.root = root
        self.files = files
        self._paths: dict[str, str] | None = None

    def read(self) -> HwmonSensors:
        if self._paths is None:
            self._paths = find_hwmon(self.root)
        values = {key: self.files.read_int(path) for key, path in self._paths.items()}
        if any(v is None for v in values.values()):
            self._paths = None
        milli, micro, tctl = values.get("npu_temp"), values.get("npu_power"), values.get("tctl")
        return HwmonSensors(None if milli is None else milli / 1000.0, None if micro is None else micro / 1e6,
                            None if tctl is None else tctl / 1000.0)


def read_hwmon(root: str = "/sys/class/hwmon") -> HwmonSensors:
    """The NPU temperature and power and the package Tctl found under `root` (None where absent)."""
    files = SensorFiles()
    try:
        return HwmonReader(root, files).read()
    finally:
        files.close()
