"""Plain PyTorch versions of every op: the truth for tests, benchmarks and the report.

Each function is what a user would write without tilefuse (the "eager unfused" anchor). Called on
float64 copies of the inputs it is the accuracy reference. One module per op family.
"""
from tilefuse.reference.linear import activation, linear  # noqa: F401
from tilefuse.reference.attention import attention, scaled_dot_product_attention  # noqa: F401
from tilefuse.reference.norms import layer_norm, layer_norm_linear, rms_norm  # noqa: F401
from tilefuse.reference.softmax import softmax, softmax_backward  # noqa: F401
