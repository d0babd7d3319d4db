"""Compute backends behind one interface (kernels/base.py): host (CPU, kernels/host/) and
xrt (NPU, kernels/xrt.py); kernels/select.py picks the one to serve with."""
