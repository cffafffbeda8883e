"""tilefuse: fused Triton kernels for transformer layers.

Fusion wins because these layers are limited by bytes moved through HBM, not arithmetic: a fused
kernel keeps intermediates on chip instead of writing them out and reading them back.

``import tilefuse`` imports torch but not triton: the kernels' modules are imported on first launch
(after :func:`tilefuse.runtime.check_triton`), so ``TRITON_INTERPRET`` can still be set before that.
"""
from tilefuse.ops.linear import linear
from tilefuse.ops.fp8_linear import QuantizedWeight, quantize_weight
from tilefuse.ops.attention import (attention, attention_varlen, flash_attn_func, flash_attn_kvpacked_func,
                                   flash_attn_qkvpacked_func, flash_attn_varlen_func, scaled_dot_product_attention)
from tilefuse.ops.fp8_attention import QuantizedQKV, quantize_qkv
from tilefuse.ops.norms import layer_norm, layer_norm_linear, rms_norm
from tilefuse.ops.softmax import softmax
from tilefuse.ops.cross_entropy import linear_cross_entropy
from tilefuse.ops.qkv import qkv_projection
from tilefuse.ops.paged import PagedKVCache, flash_attn_with_kvcache, paged_attention
from tilefuse import nn
from tilefuse import distributed
from tilefuse import masks
from tilefuse.patching import PatchReport, patch, unpatch
from tilefuse.runtime import use_backend
from tilefuse.compile_rules import use_compile_rules

# The one place the version is written: pyproject.toml reads it from here (dynamic = ["version"]).
__version__ = "0.1.0"

__all__ = ["linear", "quantize_weight", "QuantizedWeight", "attention", "quantize_qkv", "QuantizedQKV", "attention_varlen", "scaled_dot_product_attention", "flash_attn_func",
           "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "layer_norm", "rms_norm", "layer_norm_linear",
           "softmax", "linear_cross_entropy", "qkv_projection", "PagedKVCache", "paged_attention", "nn", "distributed", "masks", "patch", "unpatch", "PatchReport", "use_backend",
           "use_compile_rules", "__version__"]
