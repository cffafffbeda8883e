"""nn.Module drop-ins, state-dict compatible with their torch.nn counterparts."""
from tilefuse.nn.norm import LayerNorm, RMSNorm

__all__ = ["LayerNorm", "RMSNorm"]
