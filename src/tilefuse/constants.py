"""Names shared by the ops and the kernels (kept free of triton imports: importing tilefuse must not
import triton, so the CLI can still set TRITON_INTERPRET first)."""

# Activations an epilogue can apply; None means identity.
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
