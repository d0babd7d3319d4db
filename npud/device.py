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

import structlog

from npud.config import DeviceConfig
from npud.kernels.amdxdna import DriverRefused, power_mode, set_power_mode

log = structlog.get_logger(__name__)

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

    @property
    def fw_version(self) -> str | None:
        """The NPU firmware version the driver reports in sysfs (None where it does not)."""
        return self.sysfs.get("fw_version") or None

    def to_wire(self) -> dict:
        return {"kind": self.kind, "reason": self.reason, "nodes": list(self.nodes), "node": self.node,
                "driver": self.driver, "sysfs": dict(self.sysfs), "xrt": self.xrt, "fw_version": self.fw_version}


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


def gemm_site(device: DeviceInfo, cfg: DeviceConfig, loaded: list[dict]) -> tuple[str, str]:
    """Where the GEMMs run, "npu" or "host", and why; `loaded` is the describe() of each loaded model.

    The device being an NPU is not enough: a design table must be configured, and each of a
    model's GEMM shapes runs on the NPU only with a design that passed its start-up check."""
    if cfg.backend == "host":
        return "host", "device.backend = host"
    if device.kind != "npu":
        return "host", device.reason
    if not cfg.xrt_design:
        return "host", "no NPU GEMM design table is configured (device.xrt_design; docs/npu.md)"
    if not loaded:
        return "npu", f"design table {cfg.xrt_design}; each shape is checked against the host when a model loads"
    placements: list[str] = []
    for d in loaded:
        if not str(d.get("backend", "")).startswith("xrt"):
            return "host", f"model {d.get('name')}: {d.get('backend_reason')}"
        placements += list((d.get("gemm_placement") or {}).values())
    on_npu = [p for p in placements if p.startswith("npu")]
    if not on_npu:
        return "host", f"no GEMM shape of the loaded models runs on the NPU ({placements[0] if placements else 'none'})"
    rest = [p for p in placements if not p.startswith("npu")]
    why = f"{len(on_npu)} of {len(placements)} GEMM shapes on the NPU"
    return "npu", why + (f"; the others on the host: {rest[0]}" if rest else "")


def other_holders(node: str | None, proc_root: str = "/proc", own_pid: int | None = None) -> list[dict]:
    """Other processes with the NPU's accel node open, as far as this process may see them.

    A hardware context is made through an open file on the node, so a process holding one
    has the node open. /proc shows another user's open files only to root (or with
    CAP_SYS_PTRACE); under the unit's ProtectProc=invisible npud sees its own user's processes.
    Returns [{"pid", "comm", "drm_client_ids"}]; the DRM fdinfo client ids where the kernel gives them."""
    if node is None:
        return []
    own_pid = os.getpid() if own_pid is None else own_pid
    try:
        target = os.stat(node)
    except OSError:
        return []
    holders = []
    for pid_dir in glob.glob(os.path.join(proc_root, "[0-9]*")):
        pid = int(os.path.basename(pid_dir))
        if pid == own_pid:
            continue
        clients = []
        found = False
        for fd_path in glob.glob(os.path.join(pid_dir, "fd", "*")):
            try:
                st = os.stat(fd_path)
            except OSError:  # gone, or not ours to see
                continue
            if (st.st_rdev, st.st_ino, st.st_dev) != (target.st_rdev, target.st_ino, target.st_dev):
                continue
            found = True
            client = _fdinfo_client(os.path.join(pid_dir, "fdinfo", os.path.basename(fd_path)))
            if client is not None:
                clients.append(client)
        if found:
            try:
                comm = Path(pid_dir, "comm").read_text().strip()
            except OSError:
                comm = "?"
            holders.append({"pid": pid, "comm": comm, "drm_client_ids": clients})
    return sorted(holders, key=lambda h: h["pid"])


def _fdinfo_client(path: str) -> str | None:
    try:
        for line in Path(path).read_text(errors="replace").splitlines():
            if line.startswith("drm-client-id:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def apply_power_mode(device: DeviceInfo, mode: str, *, set_mode=set_power_mode, get_mode=power_mode) -> dict:
    """Set the NPU's power mode (`device.power_mode`; "" leaves it) and read it back: returns
    {"wanted", "current", "why"} for `device.status`, where "why" says what kept the wanted mode
    from being set (None when nothing did). Never raises.

    The driver registers the set root-only (CAP_SYS_ADMIN): npud running as its own user is
    refused, says so once (npu_power_mode_refused) with the command that sets it, and goes on."""
    wanted = mode or None
    if device.node is None or device.driver != DRIVER:
        return {"wanted": wanted, "current": None, "why": None if wanted is None else device.reason}
    why = None
    if wanted is not None:
        try:
            if set_mode(device.node, wanted):
                log.info("npu_power_mode_set", mode=wanted, node=device.node)
            else:
                why = "the driver has no power modes (a driver older than the SET_STATE ioctl)"
        except DriverRefused as exc:
            why = (f"the driver refused it ({exc.strerror}): setting the power mode needs CAP_SYS_ADMIN; "
                   f"run `sudo xrt-smi configure --pmode {wanted}` once after each boot")
        except OSError as exc:
            why = f"{device.node} does not open: {exc.strerror}"
        if why is not None:
            log.warning("npu_power_mode_refused", mode=wanted, node=device.node, why=why)
    try:
        current = get_mode(device.node)
    except OSError:
        current = None
    return {"wanted": wanted, "current": current, "why": why}
