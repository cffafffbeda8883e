"""tilefuse: fused Triton kernels for transformer layers.

Fusion wins because these layers are limited by bytes moved through HBM, not arithmetic: a fused
kernel keeps intermediates on chip instead of writing them out and reading them back.
"""
from tilefuse.ops.linear import linear
from tilefuse.ops.norms import layer_norm, layer_norm_linear, rms_norm

__version__ = "0.1.0"

__all__ = ["linear", "__version__", "layer_norm", "rms_norm", "layer_norm_linear"]
