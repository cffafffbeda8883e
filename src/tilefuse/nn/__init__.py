"""nn.Module drop-ins, state-dict compatible with their torch.nn counterparts."""
from tilefuse.nn.linear import GatedMLP, LayerNormLinear, Linear, LinearCrossEntropy, QKVProjection
from tilefuse.nn.norm import LayerNorm, RMSNorm

__all__ = ["GatedMLP", "LayerNorm", "LayerNormLinear", "Linear", "LinearCrossEntropy", "QKVProjection", "RMSNorm"]
