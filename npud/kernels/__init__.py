"""Compute backends behind one interface (npud/kernels/base.py): host (CPU, npud/kernels/host/) and
xrt (NPU, npud/kernels/xrt.py); npud/kernels/select.py picks the one to serve with."""
