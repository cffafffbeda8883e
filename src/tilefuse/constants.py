"""Names shared by the ops and the kernels (kept free of triton imports: importing tilefuse must not
import triton, so the CLI can still set TRITON_INTERPRET first)."""

# Activations an epilogue can apply; None means identity.
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")

# Gated epilogues: act(x @ W_gate^T + b_gate) * (x @ W_up^T + b_up), the GLU family of MLPs.
# swiglu = silu gate (Llama), geglu = erf GELU gate, geglu_tanh = tanh-GELU gate.
GATED_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh")

# FP8 (e4m3, torch.float8_e4m3fn): the largest finite value, what a block's amax is scaled to.
E4M3_MAX = 448.0
# FP8 attention: Q and K rows per scale (one per head and this many rows: the warp-specialized kernel's CTA and
# key tile), and the factor P is multiplied by before its e4m3 cast (p <= 1 maps to <= 256 < 448, and the
# smallest normal p becomes 2^-14 instead of 2^-6).
FP8_ATTENTION_BLOCK = 128
FP8_P_SCALE = 256.0


def fp8_v_t_strides(B: int, H: int, d: int, N: int) -> tuple[int, int, int, int]:
    """Strides of the pre-pass's e4m3 V^T [B, H, d, N]: keys contiguous, each row padded to a multiple of 16 keys
    (16 bytes), so V^T is TMA-able at any N and the warp-specialized FP8 kernel takes it. The padding is never
    read: the descriptors' bounds stop at N."""
    pitch = -(-N // 16) * 16
    return (H * d * pitch, d * pitch, pitch, 1)
