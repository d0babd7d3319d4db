"""Guards on fixture files: thermal hysteresis and abort, amdxdna error lines in a kernel log."""

import os

import pytest

import kmsg_fixtures as fx
from npud.config import ErrorsConfig, ThermalConfig
from npud.guards import ErrorCountGuard, ThermalGuard
from npud.tickets import TicketQueue


def _thermal(tmp_path, **kw):
    zone = tmp_path / "thermal_zone0"
    zone.mkdir(exist_ok=True)
    cfg = ThermalConfig(psutil_chips=(), paths=(str(tmp_path / "thermal_zone*" / "temp"),), hold_above_c=90.0,
                        hwmon_dir=str(tmp_path / "no-hwmon"),
                        resume_below_c=80.0, abort_above_c=100.0, **kw)
    queue = TicketQueue(10, 10.0)
    return ThermalGuard(cfg, queue), queue, zone / "temp"


def _set(path, celsius):
    path.write_text(f"{int(celsius * 1000)}\n")


def test_hold_resume_with_hysteresis_and_abort(tmp_path):
    guard, q, temp = _thermal(tmp_path)
    steps = [(50, "ok", False, False), (91, "hold", True, False), (85, "hold", True, False),
             (79.9, "ok", False, False), (85, "ok", False, False), (101, "abort", True, True),
             (95, "hold", True, False), (70, "ok", False, False)]
    for celsius, state, hold, abort in steps:
        _set(temp, celsius)
        guard.poll()
        assert (guard.state, q.thermal_hold, q.thermal_abort) == (state, hold, abort), celsius
        assert guard.reading_c == celsius


def test_the_hottest_sensor_counts_and_bad_files_are_skipped(tmp_path):
    guard, q, temp = _thermal(tmp_path)
    other = tmp_path / "thermal_zone1"
    other.mkdir()
    _set(temp, 40)
    _set(other / "temp", 93)
    broken = tmp_path / "thermal_zone2"
    broken.mkdir()
    (broken / "temp").write_text("garbage\n")
    guard.poll()
    assert guard.reading_c == 93.0 and q.thermal_hold
    assert str(broken / "temp") not in guard.sources and len(guard.sources) == 2


def test_no_sensor_says_so_once_and_passes(tmp_path, capsys):
    cfg = ThermalConfig(psutil_chips=("no-such-chip",), paths=(str(tmp_path / "none*"),),
                        hwmon_dir=str(tmp_path / "no-hwmon"))
    q = TicketQueue(10, 10.0)
    guard = ThermalGuard(cfg, q)
    guard.poll()
    guard.poll()
    assert guard.state == "no_sensor" and not q.thermal_hold
    assert capsys.readouterr().out.count("guard_thermal_no_sensor") == 1


def test_disabled_guard_lifts_its_hold(tmp_path):
    guard, q, temp = _thermal(tmp_path)
    _set(temp, 99)
    guard.poll()
    assert q.thermal_hold
    guard.cfg = ThermalConfig(enabled=False)
    guard.poll()
    assert guard.state == "disabled" and not q.thermal_hold


def test_psutil_chips_are_read(tmp_path, monkeypatch):
    import psutil

    from collections import namedtuple

    Entry = namedtuple("Entry", "label current high critical")
    monkeypatch.setattr(psutil, "sensors_temperatures",
                        lambda: {"k10temp": [Entry("Tctl", 97.0, None, None)], "nvme": [Entry("", 99.0, None, None)]},
                        raising=False)
    q = TicketQueue(10, 10.0)
    guard = ThermalGuard(ThermalConfig(psutil_chips=("k10temp",), paths=(), hwmon_dir=str(tmp_path / "no")), q)
    guard.poll()
    assert guard.reading_c == 97.0 and guard.sources == ["psutil:k10temp/Tctl"] and q.thermal_hold


# an error line of npud's own: it names this process's hardware context (npud/kmsg.py named_pids)
ERROR = f"amdxdna 0000:c5:00.1: [drm] *ERROR* job_timeout: timing out hwctx.{os.getpid()}.1 job 3"


def _kmsg_record(seq, message, priority=3):
    return f"{priority},{seq},{seq * 1000},-;{message}\n"


def test_error_count_follows_a_growing_log_from_startup(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text(_kmsg_record(1, ERROR))  # before start-up: not counted
    guard = ErrorCountGuard(ErrorsConfig(source=str(log)))
    assert guard.open() and guard.poll() == 0
    with open(log, "a") as f:
        f.write(_kmsg_record(2, "amdgpu 0000:c4:00.0: [drm] *ERROR* not ours"))
        f.write(_kmsg_record(3, "amdxdna 0000:c5:00.1: probe ok", priority=6))
        f.write(_kmsg_record(4, ERROR))
        f.write(_kmsg_record(5, ERROR)[:20])  # half a record: counted once it ends
    assert guard.poll() == 1
    assert guard.lines_since(0) == [ERROR]
    with open(log, "a") as f:
        f.write(_kmsg_record(5, ERROR)[20:])
    assert guard.poll() == 2
    assert guard.lines_since(1) == [ERROR]


def test_configured_patterns_and_plain_lines(tmp_path):
    log = tmp_path / "log"
    log.write_text("")
    guard = ErrorCountGuard(ErrorsConfig(source=str(log), patterns=(r"(timeout|hang)",)))
    guard.open()
    with open(log, "a") as f:  # plain lines: no priority, so a configured pattern or the drm marker decides
        f.write(f"amdxdna 0000:c5:00.1: ctx.{os.getpid()}.1 firmware hang detected\namdxdna 0000:c5:00.1: all good\n"
                "amdxdna: hang without a device address\n")
    assert guard.poll() == 1 and guard.lines_since(0) == [f"amdxdna 0000:c5:00.1: ctx.{os.getpid()}.1 firmware "
                                                          "hang detected"]


def test_a_truncated_log_is_read_from_its_start(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text("x" * 1000 + "\n")
    guard = ErrorCountGuard(ErrorsConfig(source=str(log)))
    guard.open()
    log.write_text(_kmsg_record(1, ERROR))
    assert guard.poll() == 1


def test_an_unreadable_source_is_reported_and_passes(tmp_path):
    guard = ErrorCountGuard(ErrorsConfig(source=str(tmp_path / "missing")))
    assert guard.open() is False and not guard.available and "missing" in guard.why
    assert guard.poll() == 0


def test_kmsg_style_nonblocking_source(tmp_path):
    """A FIFO behaves like /dev/kmsg: reads return what is there and then would block."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer_fd = None
    guard = ErrorCountGuard(ErrorsConfig(source=str(fifo)))
    try:
        assert guard.open()
        writer_fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.write(writer_fd, _kmsg_record(1, ERROR).encode())
        assert guard.poll() == 1
        assert guard.poll() == 1  # nothing new: no block, no double count
    finally:
        guard.close()
        if writer_fd is not None:
            os.close(writer_fd)


# -- both driver variants, pre-hang warnings, lines that are not the driver's ---------------


def _guard_on(tmp_path, records):
    log = tmp_path / "kmsg"
    log.write_text("")
    guard = ErrorCountGuard(ErrorsConfig(source=str(log)))
    assert guard.open()
    with open(log, "a") as f:
        for seq, (priority, message) in enumerate(records, 1):
            f.write(fx.record(seq, priority, message))
    guard.poll()
    return guard


@pytest.mark.parametrize("records", [fx.IN_KERNEL_ERRORS, fx.OUT_OF_TREE_ERRORS], ids=["in-kernel", "out-of-tree"])
def test_errors_of_both_driver_variants_are_counted(tmp_path, records):
    # lines that name no process: counted as the device's errors, as foreign ones
    guard = _guard_on(tmp_path, records)
    assert (guard.count, guard.foreign_count, guard.pre_hang_count) == (0, len(records), 0)
    assert guard.to_wire()["foreign_lines"] == [m for _, m in records]  # dictionary lines are not records
    # the same lines naming npud's context are its own
    own = [(p, m.replace(": ", f": hwctx.{os.getpid()}.1 ", 1)) for p, m in records]
    guard = _guard_on(tmp_path, own)
    assert (guard.count, guard.foreign_count) == (len(records), 0)
    assert guard.lines_since(0) == [m for _, m in own]


def test_pre_hang_warnings_are_counted_apart_and_surfaced(tmp_path):
    guard = _guard_on(tmp_path, fx.PRE_HANG_WARNINGS)
    assert guard.count == 0 and guard.pre_hang_count == len(fx.PRE_HANG_WARNINGS)
    wire = guard.to_wire()
    assert wire["pre_hang_count"] == 3 and wire["pre_hang_lines"][0].endswith("Device isn't making progress... "
                                                                               "Count 1 timeout 2 dump_only 0")


@pytest.mark.parametrize("priority, message", fx.NOT_THE_DRIVER)
def test_lines_that_are_not_the_drivers_errors_do_not_count(tmp_path, priority, message):
    guard = _guard_on(tmp_path, [(priority, message)])
    assert (guard.count, guard.pre_hang_count) == (0, 0)


def test_a_mixed_log_counts_each_kind(tmp_path):
    own = fx.own_errors(os.getpid())
    records = fx.NOT_THE_DRIVER + fx.IN_KERNEL_ERRORS + fx.PRE_HANG_WARNINGS + own + fx.OUT_OF_TREE_ERRORS
    guard = _guard_on(tmp_path, records)
    assert (guard.count, guard.pre_hang_count) == (len(own), 3)
    assert guard.foreign_count == len(fx.IN_KERNEL_ERRORS) + len(fx.OUT_OF_TREE_ERRORS)


@pytest.mark.parametrize("priority, message", fx.BENIGN_ERRORS)
def test_error_lines_any_process_can_cause_are_benign(tmp_path, priority, message):
    guard = _guard_on(tmp_path, [(priority, message)])
    assert (guard.count, guard.benign_count) == (0, 1) and guard.to_wire()["benign_count"] == 1


def test_benign_lines_leave_the_real_errors_counted_and_config_extends_them(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text("")
    extra = ErrorsConfig(source=str(log), benign_patterns=(r"aie2_query_firmware_version: .* ret -95$",))
    guard = ErrorCountGuard(extra)
    assert guard.open()
    own = fx.DEV + "[drm] *ERROR* aie2_query_firmware_version: Failed to query fw version, ret -95"
    lookalike = fx.DEV + f"[drm] *ERROR* aie2_get_info: Not supported request parameter 4 (and then ctx.{os.getpid()}.1 hung)"
    errors = fx.own_errors(os.getpid())
    with open(log, "a") as f:
        for seq, (priority, message) in enumerate(fx.BENIGN_ERRORS + [(3, own), (3, lookalike)] + errors, 1):
            f.write(fx.record(seq, priority, message))
    guard.poll()
    assert guard.benign_count == len(fx.BENIGN_ERRORS) + 1
    assert guard.lines_since(0) == [lookalike] + [m for _, m in errors]
    guard.reconfigure(ErrorsConfig(source=str(log)))  # the extension gone: that line is an error again
    with open(log, "a") as f:
        f.write(fx.record(99, 3, own))
    assert guard.poll() == len(errors) + 1 and guard.foreign_count == 1  # it names no process


# -- a laptop's NPU is shared: only lines that name npud's processes count ------------------


def test_another_processs_driver_lines_are_counted_apart_and_never_grow_the_count(tmp_path):
    other = os.getpid() + 1
    records = fx.FOREIGN_ERRORS + fx.own_errors(other)  # naming nothing, or another process
    guard = _guard_on(tmp_path, records)
    assert (guard.count, guard.foreign_count) == (0, len(records))
    wire = guard.to_wire()
    assert wire["count"] == 0 and wire["foreign_count"] == len(records)
    assert wire["foreign_lines"] == [m for _, m in records][-len(wire["foreign_lines"]):]
    assert guard.lines_since(0) == []


def test_lines_that_name_npuds_pid_or_context_are_its_own(tmp_path):
    records = fx.own_errors(os.getpid())
    guard = _guard_on(tmp_path, records)
    assert (guard.count, guard.foreign_count) == (len(records), 0)
    assert guard.lines_since(0) == [m for _, m in records]


def test_a_claimed_worker_pid_makes_its_lines_own_read_before_or_after_the_claim(tmp_path):
    worker = os.getpid() + 7  # an NPU worker: its pid is known once its model has loaded
    log = tmp_path / "kmsg"
    log.write_text("")
    guard = ErrorCountGuard(ErrorsConfig(source=str(log)))
    assert guard.open()
    early, late = fx.own_errors(worker)[0][1], fx.own_errors(worker)[3][1]
    someone_else = fx.own_errors(worker + 1)[2][1]
    with open(log, "a") as f:
        f.write(fx.record(1, 3, early))
        f.write(fx.record(2, 3, someone_else))
    assert guard.poll() == 0 and guard.foreign_count == 2
    guard.claim(worker)
    assert guard.count == 0  # taken in at the next poll (claims may come from the loading thread)
    assert guard.poll() == 1 and guard.foreign_count == 1 and guard.lines_since(0) == [early]
    with open(log, "a") as f:
        f.write(fx.record(3, 3, late))
    assert guard.poll() == 2 and guard.lines_since(1) == [late]
    assert worker in guard.to_wire()["own_pids"] and os.getpid() in guard.to_wire()["own_pids"]


# -- the NPU's own sensor first, then k10temp ----------------------------------------------

def _hwmon(root, index, name, files):
    d = root / f"hwmon{index}"
    d.mkdir(parents=True)
    (d / "name").write_text(name + "\n")
    for file, value in files.items():
        (d / file).write_text(f"{value}\n")


def _thermal_guard(tmp_path):
    return ThermalGuard(ThermalConfig(psutil_chips=("k10temp",), paths=(), hwmon_dir=str(tmp_path / "hwmon"),
                                      hold_above_c=90.0, resume_below_c=80.0), TicketQueue(10, 10.0))


def test_the_npu_sensor_and_tctl_count_by_the_hotter_and_the_npu_power_is_reported(tmp_path, monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "sensors_temperatures", lambda: pytest.fail("psutil read with hwmon present"),
                        raising=False)
    root = tmp_path / "hwmon"
    _hwmon(root, 0, "k10temp", {"temp1_label": "Tctl", "temp1_input": 95000, "temp3_label": "Tccd1",
                                "temp3_input": 99000})
    _hwmon(root, 3, "amdxdna", {"temp1_label": "NPU_temperature", "temp1_input": 61500,
                                "power1_label": "NPU_power", "power1_input": 1850000})
    guard = _thermal_guard(tmp_path)
    guard.poll()
    assert guard.reading_c == 95.0 and guard.sources == ["hwmon:amdxdna/NPU_temperature", "hwmon:k10temp/Tctl"]
    assert guard.npu_power_w == 1.85 and guard.to_wire()["npu_power_w"] == 1.85
    assert guard.state == "hold"  # an NPU at 61.5 C in a package at 95 C: the package holds it
    (root / "hwmon3" / "temp1_input").write_text("99500\n")  # now the NPU is the hotter
    (root / "hwmon0" / "temp1_input").write_text("70000\n")
    guard.poll()
    assert guard.reading_c == 99.5 and guard.state == "hold"


def test_k10temp_tctl_when_the_npu_has_no_sensor(tmp_path):
    root = tmp_path / "hwmon"
    _hwmon(root, 0, "nvme", {"temp1_label": "Composite", "temp1_input": 99000})
    _hwmon(root, 1, "k10temp", {"temp1_label": "Tctl", "temp1_input": 91000, "temp3_label": "Tccd1",
                                "temp3_input": 99000})
    guard = _thermal_guard(tmp_path)
    guard.poll()
    assert guard.reading_c == 91.0 and guard.sources == ["hwmon:k10temp/Tctl"] and guard.state == "hold"
    assert guard.npu_power_w is None


def test_an_npu_power_that_only_averages_is_read(tmp_path):
    _hwmon(tmp_path / "hwmon", 2, "amdxdna", {"power1_label": "NPU_power", "power1_average": 2000000})
    from npud.hwmon import read_hwmon

    sensors = read_hwmon(str(tmp_path / "hwmon"))
    assert sensors.npu_power_w == 2.0 and sensors.npu_temp_c is None


# -- real hardware ---------------------------------------------------------------------------

def _real_amdxdna_hwmon() -> bool:
    import glob as _glob

    for name in _glob.glob("/sys/class/hwmon/hwmon*/name"):
        try:
            if open(name).read().strip() == "amdxdna":
                return True
        except OSError:
            continue
    return False


@pytest.mark.npu
@pytest.mark.skipif(not _real_amdxdna_hwmon(),
                    reason="needs the amdxdna hwmon device (an NPU on a kernel where amdxdna works with AMD PMF)")
def test_npu_the_real_amdxdna_sensor_reads():
    from npud.hwmon import read_hwmon

    sensors = read_hwmon()
    # the labels npud looks for; if this fails, list /sys/class/hwmon/hwmon*/ of the amdxdna device
    assert sensors.npu_temp_c is not None and 0 < sensors.npu_temp_c < 125
    assert sensors.npu_power_w is None or 0 <= sensors.npu_power_w < 100


# -- fail closed, and follow a replaced log (issue 17, defect 10) -----------------------------------

def test_a_sensor_that_goes_bad_during_a_hold_keeps_the_hold(tmp_path):
    guard, q, temp = _thermal(tmp_path)
    _set(temp, 95)
    guard.poll()
    assert q.thermal_hold
    temp.write_text("garbage\n")  # the sensor turns unreadable while it is hot
    guard.poll()
    # before: the guard switched to no_sensor and lifted the hold
    assert guard.state == "sensor_lost" and q.thermal_hold and guard.to_wire()["state"] == "sensor_lost"
    temp.unlink()
    guard.poll()
    assert guard.state == "sensor_lost" and q.thermal_hold
    _set(temp, 70)  # back, and cool
    guard.poll()
    assert guard.state == "ok" and not q.thermal_hold


def test_a_sensor_lost_during_an_abort_keeps_the_abort(tmp_path):
    guard, q, temp = _thermal(tmp_path)
    _set(temp, 101)
    guard.poll()
    temp.write_text("")
    guard.poll()
    assert guard.state == "sensor_lost" and q.thermal_hold and q.thermal_abort


def test_a_replaced_kernel_log_is_reopened(tmp_path):
    log_file = tmp_path / "kmsg"
    log_file.write_text("")
    guard = ErrorCountGuard(ErrorsConfig(source=str(log_file)))
    guard.open()
    with open(log_file, "a") as f:
        f.write(ERROR + "\n")
    assert guard.poll() == 1
    log_file.unlink()  # rotated away: unlink + recreate
    log_file.write_text(ERROR + "\n")
    # before: the guard kept reading the unlinked file and counted nothing more
    assert guard.poll() == 2
    with open(log_file, "a") as f:
        f.write(ERROR + "\n")
    assert guard.poll() == 3


# -- a full descriptor table (issue 26) ----------------------------------------------------------

@pytest.mark.parametrize("where", ["paths", "hwmon"])
def test_the_thermal_guard_reads_on_when_every_descriptor_is_taken(tmp_path, where):
    # before: each poll opened its sensor files; with the table full (idle connections) the
    # open failed, the sensor counted as lost and the guard held all device work
    import resource
    if where == "paths":
        guard, q, temp = _thermal(tmp_path)
    else:
        _hwmon(tmp_path / "hwmon", 0, "k10temp", {"temp1_label": "Tctl", "temp1_input": 0})
        guard, q, temp = _thermal_guard(tmp_path), None, tmp_path / "hwmon" / "hwmon0" / "temp1_input"
        q = guard.queue
    _set(temp, 95)
    guard.poll()
    assert guard.state == "hold"
    writer = os.open(temp, os.O_WRONLY)  # the new reading is written through a descriptor opened now
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    taken = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
        with pytest.raises(OSError):
            while True:
                taken.append(os.open(os.devnull, os.O_RDONLY))
        os.ftruncate(writer, 0)
        os.pwrite(writer, b"40000\n", 0)
        guard.poll()
        state, hold = guard.state, q.thermal_hold
    finally:
        for fd in taken:
            os.close(fd)
        os.close(writer)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert (state, hold) == ("ok", False)
