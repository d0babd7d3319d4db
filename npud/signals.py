"""Which signals npud acts on, and which it ignores on purpose.

Stop signals (SIGTERM, SIGINT, SIGQUIT) start the drain; another one during the drain only
hurries it (npud/daemon.py). SIGHUP reloads the config; SIGUSR1 logs the status line. Every
other signal whose default action would end the process and that is not a fault of the process
itself is ignored, so that a stray `kill -USR2` or a power-event signal cannot end npud without
its drain. Fault signals (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP, SIGSYS) keep their
default: ignoring them would hide a real crash. SIGKILL and SIGSTOP cannot be caught.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import trio

STOP = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGQUIT})
RELOAD = signal.SIGHUP
STATUS = signal.SIGUSR1
HANDLED = STOP | {RELOAD, STATUS}
# default action "terminate" or "stop the process": nothing npud should do on them
IGNORED = frozenset({signal.SIGUSR2, signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF, signal.SIGPWR,
                     signal.SIGIO, signal.SIGSTKFLT, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU,
                     signal.SIGXCPU, signal.SIGXFSZ, signal.SIGPIPE,
                     *range(signal.SIGRTMIN, signal.SIGRTMAX + 1)})


def name(signum: int) -> str:
    """SIGTERM, ...; a real-time signal has no name of its own in Python."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}"


@contextlib.contextmanager
def receiver() -> Iterator[trio.abc.ReceiveChannel]:
    """Ignore IGNORED and yield a trio signal receiver for HANDLED (main thread only).

    The handled signals are set to "ignore" before the receiver is opened, so that when it
    closes (at the end of the drain) they stay ignored while the store is closed and the
    process exits, instead of falling back to their default of ending the process there."""
    for signum in IGNORED | HANDLED:
        signal.signal(signum, signal.SIG_IGN)
    with trio.open_signal_receiver(*HANDLED) as signals:
        yield signals
