"""Guards that decide whether the device may be driven: heat and amdxdna driver errors.

ThermalGuard polls temperature sensors (the NPU's own and the package's, where the drivers
register them) and sets the queue's hold/abort flags with hysteresis. ErrorCountGuard follows
the kernel log and counts the amdxdna device's error records (npud/kmsg.py says which); the
device owner reads the count when a ticket is granted and released, and a count that grew in
between faults the ticket and quarantines the device. Pre-hang warnings are counted beside it.

The NPU is shared with every other program on the laptop (FastFlowLM, `xrt-smi validate`, a
second user's runtime), and the driver logs their failures in the same kernel log: another
process's context that cannot be created ("Create hwctx failed", "Allocate AIE resource
failed" when the array is full), another context's "TDR timeout detected". So the count that
faults holds only npud's own evidence: error lines that name one of npud's processes, through
a pid or a hardware context's name (npud/kmsg.py `named_pids`; the daemon and its NPU workers,
`claim`). Every other error line is *foreign*: logged and counted apart (`foreign_count`),
never faulted on. npud's own failures do not hide there: a run of npud's that the driver times
out or aborts ends in a run state other than completed, and a worker that dies is seen by its
pipe, each a fault of its own (npud/device_owner.py).

Some of the driver's error-level lines say nothing about the device's health and can be caused
by any process that opens it: an ioctl parameter the driver does not know (an XRT or xrt-smi
newer than the driver, another user's monitoring tool) prints "Not supported request
parameter N" from aie2_get_info / aie2_get_array / aie2_set_state, in both drivers (npu1 and
Strix/Krackan's npu4/5/6 all run the aie2_* functions; aie4_* is a later generation's, npu3). Those are BENIGN_PATTERNS: counted apart, never faulted on. `errors.benign_patterns`
extends the list.
"""

from __future__ import annotations

import collections
import errno
import glob
import os
import re
import stat

import psutil
import structlog
import trio

from npud.config import ErrorsConfig, ThermalConfig
from npud.hwmon import HwmonReader, HwmonSensors, SensorFiles
from npud.kmsg import Kind, Matcher, named_pids, parse
from npud.tickets import TicketQueue

log = structlog.get_logger(__name__)

MAX_KEPT_LINES = 1000  # error lines remembered for fault reports
MAX_KEPT_PRE_HANG = 20  # the last pre-hang warnings, shown by `npuctl device`
MAX_KEPT_FOREIGN = 20  # the last foreign error lines, shown by `npuctl device`
MAX_UNCLAIMED = 1000  # foreign lines naming a pid, kept until that pid may be claimed

# The drivers' XDNA_ERR("Not supported request parameter %u") of the query/set ioctls (both
# drivers, aie2_pci.c for npu1 and npu4/5/6, aie4_pci.c for the later npu3), after "function: "
# and, in-kernel, "[drm] *ERROR* "
BENIGN_PATTERNS = (
    r": (\[drm\] \*ERROR\* )?aie[24]_(get_info|get_array|get_array_hwctx|set_state): "
    r"Not supported request parameter \d+$",
)


class ThermalGuard:
    def __init__(self, cfg: ThermalConfig, queue: TicketQueue) -> None:
        self.cfg = cfg
        self.queue = queue
        self.reading_c: float | None = None
        self.sources: list[str] = []
        self.state = "disabled" if not cfg.enabled else "ok"
        self.npu_power_w: float | None = None  # hwmon amdxdna NPU_power, where the driver has it
        self._said_no_sensor = False
        self._had_reading = False  # a sensor has been read since start-up: losing it fails closed
        self._files = SensorFiles()  # held open: a full descriptor table must not blind the guard
        self._hwmon: HwmonReader | None = None
        self._matches: dict[str, list[str]] = {}  # the last non-empty expansion of each `paths` glob

    def read(self) -> tuple[float | None, list[str]]:
        """The temperature to act on in degrees C (None if no sensor could be read) and its sources.

        The NPU's own sensor (hwmon "amdxdna", NPU_temperature) and the package's (hwmon
        "k10temp", Tctl), both where the drivers register them (the NPU sits in the package: a
        cool NPU under a package at its limit must not be driven harder); else the configured
        psutil chips. The configured `paths` are read in every case and the hottest reading counts."""
        readings: list[tuple[float, str]] = []
        if self.cfg.hwmon_dir and (self._hwmon is None or self._hwmon.root != self.cfg.hwmon_dir):
            self._hwmon = HwmonReader(self.cfg.hwmon_dir, self._files)
        sensors = self._hwmon.read() if self.cfg.hwmon_dir else HwmonSensors()
        self.npu_power_w = sensors.npu_power_w
        if sensors.npu_temp_c is not None:
            readings.append((sensors.npu_temp_c, "hwmon:amdxdna/NPU_temperature"))
        if sensors.tctl_c is not None:
            readings.append((sensors.tctl_c, "hwmon:k10temp/Tctl"))
        if not readings and self.cfg.psutil_chips:
            try:
                chips = psutil.sensors_temperatures()
            except (AttributeError, OSError):  # no sensor support on this platform
                chips = {}
            for chip in self.cfg.psutil_chips:
                for entry in chips.get(chip, ()):
                    if entry.current is not None:
                        readings.append((float(entry.current), f"psutil:{chip}/{entry.label or 'temp'}"))
        for pattern in self.cfg.paths:
            paths = [pattern]
            if glob.has_magic(pattern):  # globbing opens directories: keep the last good expansion
                paths = self._matches[pattern] = sorted(glob.glob(pattern)) or self._matches.get(pattern, [])
            for path in paths:
                milli = self._files.read_int(path)
                if milli is None:
                    continue  # a sensor that vanished or reads garbage is not a reading
                readings.append((milli / 1000.0, path))
        if not readings:
            return None, []
        return max(r for r, _ in readings), [s for _, s in readings]

    def evaluate(self, reading: float | None) -> None:
        """Move the hold/abort state for a new reading and tell the queue."""
        cfg, q = self.cfg, self.queue
        self.reading_c = reading
        if reading is None and self._had_reading:
            # A sensor that was read and now is not may be failing because the part is hot:
            # fail closed, keeping whatever hold or abort is in force, and say so.
            if self.state != "sensor_lost":
                log.error("guard_thermal_sensor_lost", hold=q.thermal_hold, abort=q.thermal_abort,
                          chips=list(cfg.psutil_chips), paths=list(cfg.paths))
            self.state = "sensor_lost"
            return
        if reading is None:
            if not self._said_no_sensor:
                log.warning("guard_thermal_no_sensor", chips=list(cfg.psutil_chips), paths=list(cfg.paths))
                self._said_no_sensor = True
            self.state = "no_sensor"
            if q.thermal_hold or q.thermal_abort:
                q.set_thermal(hold=False, abort=False)
            return
        if self.state == "sensor_lost":
            log.warning("guard_thermal_sensor_back", reading_c=reading)
        self._had_reading = True
        hold, abort = q.thermal_hold, reading > cfg.abort_above_c
        if reading > cfg.hold_above_c:
            hold = True
        elif hold and reading < cfg.resume_below_c:
            hold = False
        if abort and not q.thermal_abort:
            log.warning("guard_thermal_abort", reading_c=reading, abort_above_c=cfg.abort_above_c)
        if hold and not q.thermal_hold:
            log.warning("guard_thermal_hold", reading_c=reading, hold_above_c=cfg.hold_above_c)
        if not hold and q.thermal_hold:
            log.info("guard_thermal_resume", reading_c=reading, resume_below_c=cfg.resume_below_c)
        self.state = "abort" if abort else "hold" if hold else "ok"
        if (hold, abort) != (q.thermal_hold, q.thermal_abort):
            q.set_thermal(hold=hold, abort=abort)

    def poll(self) -> None:
        if not self.cfg.enabled:
            self.state, self.reading_c, self.sources = "disabled", None, []
            if self.queue.thermal_hold or self.queue.thermal_abort:
                self.queue.set_thermal(hold=False, abort=False)
            return
        reading, self.sources = self.read()
        self.evaluate(reading)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.poll()  # the first reading is in before the first grant
        task_status.started()
        while True:
            await trio.sleep(self.cfg.poll_interval_s)
            self.poll()

    def close(self) -> None:
        """Close the held sensor files."""
        self._files.close()

    def to_wire(self) -> dict:
        return {"state": self.state, "reading_c": self.reading_c, "sources": self.sources,
                "npu_power_w": self.npu_power_w,
                "hold_above_c": self.cfg.hold_above_c, "resume_below_c": self.cfg.resume_below_c,
                "abort_above_c": self.cfg.abort_above_c}


class ErrorCountGuard:
    """Counts the amdxdna device's kernel-log errors that name npud's processes (and, apart, the
    other error lines, the benign ones and the pre-hang warnings) from start-up on.

    Reads /dev/kmsg (one record per read, non-blocking) or, for tests and other setups, any
    file that grows by lines. Only records written after the daemon started are counted.
    """

    def __init__(self, cfg: ErrorsConfig, *, own_pid: int | None = None) -> None:
        self.cfg = cfg
        self._matcher = Matcher(cfg.patterns, cfg.pre_hang_patterns)
        self._benign = _benign(cfg)
        self.count = 0  # npud's own error lines: what faults a ticket
        self.foreign_count = 0  # error lines that name no process of npud's: counted, never faulted on
        self.benign_count = 0  # error-level lines any process can cause: counted, never faulted on
        self.pre_hang_count = 0
        self.own_pids: set[int] = {os.getpid() if own_pid is None else own_pid}
        self._claimed: list[int] = []  # pids claimed from another thread, taken in at the next poll
        self._foreign: collections.deque[str] = collections.deque(maxlen=MAX_KEPT_FOREIGN)
        # foreign lines that name some pid: theirs until that pid turns out to be npud's
        self._unclaimed: collections.deque[tuple[frozenset[int], str]] = collections.deque(maxlen=MAX_UNCLAIMED)
        self._pre_hang: collections.deque[str] = collections.deque(maxlen=MAX_KEPT_PRE_HANG)
        self.available = False
        self.why: str | None = None
        self._fd: int | None = None
        self._pos = 0
        self._partial = b""
        self._lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=MAX_KEPT_LINES)

    def reconfigure(self, cfg: ErrorsConfig) -> None:
        reopen = cfg.source != self.cfg.source or cfg.enabled != self.cfg.enabled
        self.cfg = cfg
        self._matcher = Matcher(cfg.patterns, cfg.pre_hang_patterns)
        self._benign = _benign(cfg)
        if reopen:
            self.close()
            if cfg.enabled:
                self.open()

    def open(self, *, at_end: bool = True) -> bool:
        """Open the source; at_end: count only what is written from now on (else the whole
        file: a recreated log holds only new records). Returns whether it could be opened."""
        self._partial = b""
        try:
            self._fd = os.open(self.cfg.source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                self._pos = os.lseek(self._fd, 0, os.SEEK_END if at_end else os.SEEK_SET)
            except OSError as exc:
                if exc.errno != errno.ESPIPE:  # a pipe has no past to skip
                    raise
                self._pos = 0
        except OSError as exc:
            self._fd = None
            self.available = False
            self.why = f"cannot read {self.cfg.source}: {exc.strerror}"
            log.warning("guard_errors_unavailable", source=self.cfg.source, error=exc.strerror)
            return False
        self.available, self.why = True, None
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None
        self.available = False

    def claim(self, pid: int | None) -> None:
        """Count `pid` as npud's (an NPU worker it started): the lines that name it, read before
        or after, are npud's own. Safe from any thread; taken in at the next poll."""
        if pid is not None:
            self._claimed.append(int(pid))

    def _take_claims(self) -> None:
        while self._claimed:
            pid = self._claimed.pop()
            if pid in self.own_pids:
                continue
            self.own_pids.add(pid)
            kept = collections.deque(maxlen=MAX_UNCLAIMED)
            for pids, message in self._unclaimed:
                if pid in pids:  # read before the pid was known to be npud's: its own line after all
                    self.foreign_count -= 1
                    self._own_line(message, reattributed=True)
                else:
                    kept.append((pids, message))
            self._unclaimed = kept

    def poll(self) -> int:
        """Read every record written since the last poll; returns the count of npud's own error
        lines so far."""
        self._take_claims()
        fd = self._fd
        if fd is None:  # disabled, or the source could not be opened (said once, at open)
            return self.count
        self._read(fd)
        if self._replaced(fd):  # a log file rotated or recreated: follow the new one from its start
            self.close()
            if self.open(at_end=False):
                log.warning("guard_errors_source_reopened", source=self.cfg.source)
                self._read(self._fd)
        return self.count

    def _replaced(self, fd: int) -> bool:
        """Whether the source path now names another file than the one open (regular files only:
        /dev/kmsg is never replaced)."""
        try:
            st = os.stat(self.cfg.source)
        except OSError:
            return False  # gone for now: keep reading the old one until a new one appears
        old = os.fstat(fd)
        return stat.S_ISREG(old.st_mode) and (st.st_dev, st.st_ino) != (old.st_dev, old.st_ino)

    def _read(self, fd: int) -> None:
        """Count the records written to `fd` since the last read."""
        size = os.fstat(fd).st_size
        if 0 < size < self._pos:  # a regular file was truncated
            self._pos = os.lseek(fd, 0, os.SEEK_SET)
            self._partial = b""
        while True:
            try:
                data = os.read(fd, 8192)
            except BlockingIOError:
                break  # /dev/kmsg: no new record
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # /dev/kmsg overwrote records we had not read yet
                    log.warning("guard_errors_records_lost", source=self.cfg.source)
                    continue
                raise
            if not data:
                break  # a regular file: at its end
            self._pos += len(data)
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()
            for raw in lines:
                self._record(raw.decode("utf-8", "replace"))

    def _record(self, line: str) -> None:
        record = parse(line)
        kind = self._matcher.classify(record)
        if kind is Kind.ERROR and any(p.search(record.message) for p in self._benign):
            self.benign_count += 1
            log.info("guard_device_benign_line", count=self.benign_count, line=record.message)
        elif kind is Kind.ERROR:
            pids = named_pids(record.message)
            if pids & self.own_pids:
                self._own_line(record.message)
            else:
                self.foreign_count += 1
                self._foreign.append(record.message)
                if pids:
                    self._unclaimed.append((pids, record.message))
                log.info("guard_device_foreign_line", count=self.foreign_count, pids=sorted(pids),
                         line=record.message)
        elif kind is Kind.PRE_HANG:
            self.pre_hang_count += 1
            self._pre_hang.append(record.message)
            log.warning("guard_device_pre_hang_warning", count=self.pre_hang_count, line=record.message)

    def _own_line(self, message: str, *, reattributed: bool = False) -> None:
        self.count += 1
        self._lines.append((self.count, message))
        log.warning("guard_device_error_line", count=self.count, line=message, reattributed=reattributed)

    def lines_since(self, count: int) -> list[str]:
        """The error lines counted after `count` (those still remembered)."""
        return [line for n, line in self._lines if n > count]

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if self.cfg.enabled:
            self.open()
        task_status.started()
        while True:
            await trio.sleep(self.cfg.poll_interval_s)
            self.poll()

    def to_wire(self) -> dict:
        return {"count": self.count, "source": self.cfg.source, "available": self.available, "why": self.why,
                "patterns": list(self.cfg.patterns), "benign_count": self.benign_count,
                "foreign_count": self.foreign_count, "foreign_lines": list(self._foreign),
                "own_pids": sorted(self.own_pids),
                "pre_hang_count": self.pre_hang_count,
                "pre_hang_lines": list(self._pre_hang)}


def _benign(cfg: ErrorsConfig) -> list[re.Pattern]:
    return [re.compile(p) for p in BENIGN_PATTERNS + cfg.benign_patterns]
