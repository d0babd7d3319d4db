"""Kernel log records, and which of them are the amdxdna driver's errors and pre-hang warnings.

/dev/kmsg gives one record per read: "PRIORITY,SEQ,USEC,FLAGS;MESSAGE", where PRIORITY is
facility * 8 + level, then dictionary lines that begin with a space (" SUBSYSTEM=pci",
" DEVICE=+pci:0000:c5:00.1"). The kernel gives facility 0 to its own messages only: a
process writing to /dev/kmsg gets LOG_USER (1) whatever prefix it writes.

Both amdxdna drivers print through dev_printk, so a message of theirs begins with the driver
name and the PCI address, "amdxdna 0000:c5:00.1: ". Their XDNA_ERR differs:
  - the in-kernel driver (drivers/accel/amdxdna/amdxdna_pci_drv.h) uses drm_err, which adds
    "[drm] *ERROR* " before "function: message";
  - the out-of-tree driver (amd/xdna-driver, src/driver/amdxdna/amdxdna_drm.h) uses
    dev_err_ratelimited: "function: message" with no marker.
Both are level 3 (err). An error is therefore: facility kernel, level <= err, from an
amdxdna PCI device. A line that only contains the driver's name (a process called
"amdxdna*ERROR*" that segfaults, another device's "[drm] *ERROR*") is not one.

Some error lines name the process or the hardware context they concern: both drivers name a
context "<prefix>.<pid>.<id>" (in-kernel amdxdna_ctx.c: "hwctx.%d.%d"; out-of-tree: "ctx.%d.%d"),
and a few lines name the process itself ("PID %d failed to get ctx %d", "Context %u for pid %llu
not found", "Invalid context ID %d for PID %d"). `named_pids` reads those pids; a line that names
none (a failed context creation, "Allocate AIE resource failed", "TDR timeout detected") cannot
be pinned on any process.

Pre-hang warnings are XDNA_WARN (level 4) lines that come before a hang or a firmware reset
(aie2_tdr.c "Device isn't making progress...", aie2_pci.c "NPU firmware unhealthy:
power-cycling NPU", aie2_ctx.c "Firmware unresponsive, power-cycling NPU"): counted apart
and surfaced, not faulted on.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

KERNEL_FACILITY = 0
LEVEL_ERR = 3
LEVEL_WARNING = 4

_RECORD = re.compile(r"^(\d+),(\d+),(\d+),[^;]*;(.*)$")
# dev_printk's "<driver> <PCI domain:bus:device.function>: "
DEVICE_PREFIX = re.compile(r"^amdxdna [0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]: ")
DRM_ERROR = re.compile(r"^amdxdna [0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]: \[drm\] \*ERROR\* ")

# a hardware context's name, "hwctx.<pid>.<id>" or "ctx.<pid>.<id>", and "PID <pid>" / "pid <pid>"
_CONTEXT_NAME = re.compile(r"(?<![\w.])(?:hw)?ctx\.(\d+)\.\d+\b")
_PID = re.compile(r"\b(?:PID|pid) (\d+)\b")

PRE_HANG_PATTERNS = (
    r"Device isn't making progress",
    r"NPU firmware unhealthy",
    r"power-cycling NPU",
)


class Kind(enum.Enum):
    ERROR = "error"
    PRE_HANG = "pre_hang"


@dataclass(slots=True, frozen=True)
class Record:
    message: str
    facility: int | None = None  # None: a plain line (a log file without kmsg prefixes)
    level: int | None = None


def parse(line: str) -> Record:
    """One /dev/kmsg record, or a plain log line (a dictionary line " KEY=value" is one too,
    and never begins with a device prefix)."""
    m = _RECORD.match(line)
    if m is None:
        return Record(line)
    priority = int(m.group(1))
    return Record(m.group(4), facility=priority >> 3, level=priority & 7)


def named_pids(message: str) -> frozenset[int]:
    """The process ids a driver line names, through a hardware context's name or "PID n"
    (empty: the line does not say whose it is)."""
    return frozenset(int(m.group(1)) for pattern in (_CONTEXT_NAME, _PID) for m in pattern.finditer(message))


class Matcher:
    """Classifies records: errors of either driver, pre-hang warnings, extra error patterns."""

    def __init__(self, extra_patterns: tuple[str, ...] = (), pre_hang_patterns: tuple[str, ...] = PRE_HANG_PATTERNS):
        self.extra = [re.compile(p) for p in extra_patterns]
        self.pre_hang = [re.compile(p) for p in pre_hang_patterns]

    def classify(self, record: Record) -> Kind | None:
        """ERROR, PRE_HANG or None (not the driver's, or nothing to count)."""
        msg = record.message
        if record.facility is not None and record.facility != KERNEL_FACILITY:
            return None  # written by a process, not by the kernel
        if not DEVICE_PREFIX.match(msg):
            return None
        if record.level is None:  # no priority to go by: only the in-kernel driver's marker says error
            is_error = DRM_ERROR.match(msg) is not None
        else:
            is_error = record.level <= LEVEL_ERR
        if is_error or any(p.search(msg) for p in self.extra):
            return Kind.ERROR
        if (record.level is None or record.level <= LEVEL_WARNING) and any(p.search(msg) for p in self.pre_hang):
            return Kind.PRE_HANG
        return None
