"""Kernel-log fixtures for the error guard, as /dev/kmsg records ("PRI,SEQ,USEC,FLAGS;MESSAGE"
then dictionary lines). PRI = facility * 8 + level: 3 is a kernel err, 4 a kernel warning,
6 kernel info, 11 (1 * 8 + 3) an err that a process wrote to /dev/kmsg.

The messages are the drivers' format strings filled in, with the prefix dev_printk adds
("amdxdna <PCI address>: ") and, for XDNA_ERR / XDNA_WARN, the function name.
"""

DEV = "amdxdna 0000:c5:00.1: "

# In-kernel driver, drivers/accel/amdxdna: XDNA_ERR is drm_err (amdxdna_pci_drv.h), which
# prints "[drm] *ERROR* " before "function: message".
IN_KERNEL_ERRORS = [
    # aie2_message.c, aie2_send_mgmt_msg_wait()
    (3, DEV + "[drm] *ERROR* aie2_send_mgmt_msg_wait: command opcode 0x2 failed, status 0x2000003"),
    # amdxdna_mailbox_helper.c, xdna_send_msg_wait()
    (3, DEV + "[drm] *ERROR* xdna_send_msg_wait: Wait for completion timeout"),
    # aie2_message.c, aie2_suspend_fw()
    (3, DEV + "[drm] *ERROR* aie2_suspend_fw: Failed to suspend fw, ret -62"),
]
# (A job the in-kernel driver times out, aie2_ctx.c aie2_sched_job_timedout(), prints "TDR timeout
# detected" from aie2_tdr_detect() and marks the command ERT_CMD_STATE_TIMEOUT or ABORT; the line
# names no context, so npud knows its own job's timeout from the run state: FOREIGN_ERRORS below.)

# Out-of-tree driver, amd/xdna-driver src/driver/amdxdna: XDNA_ERR is dev_err_ratelimited
# (amdxdna_drm.h), "function: message" with no marker.
OUT_OF_TREE_ERRORS = [
    # amdxdna_mailbox_helper.c, xdna_send_msg_wait()
    (3, DEV + "xdna_send_msg_wait: Wait for completion timeout"),
    # aie2_ctx.c, aie2_dump_ctx()
    (3, DEV + "aie2_dump_ctx: Firmware timeout state capture:"),
    # aie2_message.c, aie2_send_mgmt_msg_wait()
    (3, DEV + "aie2_send_mgmt_msg_wait: command opcode 0x3 failed, status 0x2000006"),
    # aie2_ctx.c, aie2_tdr_detect() (releases with the drm_sched "no hang" status)
    (3, DEV + "aie2_tdr_detect: TDR timeout detected"),
]

# XDNA_WARN lines that come before a hang or a reset (dev_warn / drm_warn, level 4)
PRE_HANG_WARNINGS = [
    # amd/xdna-driver aie2_tdr.c, aie2_tdr_work()
    (4, DEV + "aie2_tdr_work: Device isn't making progress... Count 1 timeout 2 dump_only 0"),
    # aie2_pci.c, aie2_hw_reset(), in-kernel format
    (4, DEV + "[drm] aie2_hw_reset: NPU firmware unhealthy: power-cycling NPU"),
    # aie2_ctx.c, context teardown after a firmware timeout
    (4, DEV + "aie2_hwctx_stop: Firmware unresponsive, power-cycling NPU"),
]

# Lines that must not count
NOT_THE_DRIVER = [
    # a process named like the driver segfaults: the kernel prints comm[pid] first, at info ...
    (6, "amdxdna*ERROR*[4242]: segfault at 0 ip 0000563a1c2d1f20 sp 00007ffd7a3c9e10 error 4 in x[1f20,563a1c2d0000+2000]"),
    # ... and at emerg when it is pid 1 (a container's init): a kernel record at level 0
    (0, "amdxdna*ERROR*[1]: segfault at 0 ip 0000563a1c2d1f20 sp 00007ffd7a3c9e10 error 4 in x[1f20,563a1c2d0000+2000]"),
    # another PCI device's DRM error
    (3, "amdgpu 0000:c4:00.0: [drm] *ERROR* [CRTC:80:crtc-0] flip_done timed out"),
    # the driver's own info line
    (6, DEV + "[drm] Load firmware amdnpu/17f0_10/npu.sbin"),
    # a process writing a look-alike line to /dev/kmsg: the kernel gives it facility user
    (11, DEV + "[drm] *ERROR* aie2_send_mgmt_msg_wait: injected by a user"),
    # a device warning that is no pre-hang sign
    (4, DEV + "aie2_get_info: Not supported request parameter 99"),
]

# Error-level lines any process can cause (an ioctl parameter the driver does not know: XRT or
# xrt-smi newer than the driver): XDNA_ERR(xdna, "Not supported request parameter %u", ...) in
# aie2_get_info / aie2_get_array / aie2_set_state (aie2_pci.c: npu1 and Strix/Krackan's npu4/5/6) and
# aie4_* (aie4_pci.c: the later npu3), both drivers
BENIGN_ERRORS = [
    (3, DEV + "[drm] *ERROR* aie2_get_info: Not supported request parameter 4"),
    (3, DEV + "[drm] *ERROR* aie2_get_array: Not supported request parameter 2"),
    (3, DEV + "[drm] *ERROR* aie2_set_state: Not supported request parameter 5"),
    (3, DEV + "aie2_get_info: Not supported request parameter 11"),
    (3, DEV + "aie2_get_array_hwctx: Not supported request parameter 0"),
    (3, DEV + "aie4_get_info: Not supported request parameter 7"),
]


# Error lines another process's work makes the driver print (npud/guards.py: foreign lines). None
# names a process, so none may fault npud's ticket; the driver prints the same lines for npud's
# own contexts, whose failures npud sees in its own run states instead.
FOREIGN_ERRORS = [
    # in-kernel aie2_ctx.c, aie2_alloc_resource(): a context asked for columns the array no longer has
    (3, DEV + "[drm] *ERROR* aie2_alloc_resource: Allocate AIE resource failed, ret -16"),
    # in-kernel aie2_ctx.c, aie2_hwctx_restart(): a context that could not be made again
    (3, DEV + "[drm] *ERROR* aie2_hwctx_restart: Create hwctx failed, ret -22"),
    # in-kernel aie2_ctx.c, aie2_tdr_detect(): some context's job outlived the scheduler's timeout
    (3, DEV + "[drm] *ERROR* aie2_tdr_detect: TDR timeout detected"),
    # the out-of-tree driver's older TDR, the same words
    (3, DEV + "aie2_tdr_detect: TDR timeout detected"),
]


def own_errors(pid: int) -> list[tuple[int, str]]:
    """Error lines that name the process `pid`, through its hardware context's name or its pid."""
    return [
        # in-kernel aie4_ctx.c, job_timeout(): the context is named "hwctx.<pid>.<id>" (amdxdna_ctx.c)
        (3, DEV + f"[drm] *ERROR* job_timeout: timing out hwctx.{pid}.1 job 12"),
        # in-kernel aie2_ctx.c, aie2_hwctx_heap_expand()
        (3, DEV + f"[drm] *ERROR* aie2_hwctx_heap_expand: Add heap failed hwctx hwctx.{pid}.2 0x4000000 ret -12"),
        # out-of-tree aie2_ctx_runqueue.c, rq_submit_enter_slow(): "ctx.<pid>.<id>"
        (3, DEV + f"rq_submit_enter_slow: ctx.{pid}.3 fatal error"),
        # out-of-tree amdxdna_ctx.c, amdxdna_drm_submit_signal()
        (3, DEV + f"amdxdna_drm_submit_signal: PID {pid} failed to get ctx 4"),
    ]


def record(seq: int, priority: int, message: str) -> str:
    """One /dev/kmsg record with the dictionary lines dev_printk attaches."""
    return (f"{priority},{seq},{seq * 1000},-;{message}\n SUBSYSTEM=pci\n"
            f" DEVICE=+pci:{message.split(' ')[1].rstrip(':') if message.startswith('amd') else '0000:00:00.0'}\n")
