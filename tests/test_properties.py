"""Property tests: random shapes and options for the registry ops beyond the fixed test grids.

Each example builds its inputs through the op's registry entry and compares with its float64
reference, as the grid tests do; hypothesis picks the shapes (odd sizes, rows that take the chunked
path, GQA groups, windows that leave rows empty). Examples are derandomized so CI is repeatable.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import ON_GPU, check_against_reference
from tilefuse import registry

DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# Interpreter examples stay small (each program runs in Python); the GPU takes longer rows.
MAX_N = 70000 if ON_GPU else 400
MAX_SEQ = 1100 if ON_GPU else 140
# On the GPU every example compiles its own specialization (seconds each, on one worker): fewer there. In the
# interpreter an attention example costs about ten norm examples: fewer of those.
EXAMPLES = 8 if ON_GPU else 25
ATTENTION_EXAMPLES = 8 if ON_GPU else 12


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(rows=st.integers(1, 40), n=st.integers(1, MAX_N), dtype=DTYPES, residual=st.booleans(),
       affine=st.sampled_from(["both", "weight", "none"]), rms=st.booleans(), seed=st.integers(0, 1000))
def test_norm_forward_random_rows(rows, n, dtype, residual, affine, rms, seed):
    spec = registry.get("rms_norm" if rms else "layer_norm")
    if rms and affine == "both":
        affine = "weight"  # RMSNorm has no bias
    params = dict(shape=(rows, n), dtype=dtype, residual=residual, affine=affine, layout="contiguous")
    check_against_reference(spec, params, DEVICE, seed)


@settings(max_examples=ATTENTION_EXAMPLES, deadline=None, derandomize=True)
@given(b=st.integers(1, 2), hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
       nq=st.integers(1, MAX_SEQ), nk=st.integers(1, MAX_SEQ), d=st.integers(1, 256), dtype=DTYPES,
       causal=st.booleans(), left=st.integers(-1, 150), right=st.integers(-1, 150),
       windowed=st.booleans(), return_lse=st.booleans(), seed=st.integers(0, 1000))
def test_attention_random_shapes(b, hkv, group, nq, nk, d, dtype, causal, left, right, windowed, return_lse,
                                 seed):
    spec = registry.get("attention")
    window = (left, right) if windowed else None
    params = dict(shape=(b, hkv * group, hkv, nq, nk), d=d, dtype=dtype, mode=(causal, window),
                  return_lse=return_lse)
    check_against_reference(spec, params, DEVICE, seed)
