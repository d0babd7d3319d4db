"""`python -m npud.kernels.host`: compile the host GEMMs and attention into the kernel cache now (not at the first start).

Prints the shared object's path and the kernel path this CPU runs; exits 1 with the reason
when gcc is missing or fails.
"""

import sys

from npud.kernels.host import native

try:
    print(native.build(), native.best_isa())
except native.BuildError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
