"""npud: a daemon that serves local LLMs on AMD Ryzen AI NPUs (or the host CPU).

The package is the daemon; `npud.protocol` is also used by the client library and
imports nothing beyond the standard library.
"""

__version__ = "0.1.0"
