"""Plain PyTorch versions of every op: the truth for tests, benchmarks and the report.

Each function is what a user would write without tilefuse (the "eager unfused" anchor). Called on
float64 copies of the inputs it is the accuracy reference. One module per op family.
"""
from tilefuse.reference.linear import (activation, activation_slope, gate, gated_linear,  # noqa: F401
                                       gated_linear_backward, gated_slopes, linear, linear_backward,
                                       qkv_projection, rotate_half, rotate_pairs)
# The other families are imported as modules (tilefuse.reference.attention, .norms, .softmax): a
# function re-exported here under its module's name would shadow the module (reference.attention).
