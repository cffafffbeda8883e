"""@triton.jit kernels and their launchers; no argument checking or autograd here (see tilefuse.ops)."""
