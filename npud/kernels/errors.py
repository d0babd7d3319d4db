"""The backends' errors, in a module of the standard library only (npud/engine/api.py re-exports them)."""


class DeviceFault(RuntimeError):
    """An accelerator call did not complete normally (a run state other than completed, a
    timeout, an exception from the runtime). Whatever the round computed is void: the
    daemon faults the ticket, quarantines the device and commits nothing of the round."""
