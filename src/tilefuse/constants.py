"""Names shared by the ops and the kernels (kept free of triton imports: importing tilefuse must not
import triton, so the CLI can still set TRITON_INTERPRET first)."""

# Activations an epilogue can apply; None means identity.
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")

# Gated epilogues: act(x @ W_gate^T + b_gate) * (x @ W_up^T + b_up), the GLU family of MLPs.
# swiglu = silu gate (Llama), geglu = erf GELU gate, geglu_tanh = tanh-GELU gate.
GATED_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh")
