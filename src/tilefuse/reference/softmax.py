"""Reference for softmax: torch.softmax, and the textbook backward formula."""

import torch


def softmax(x: torch.Tensor, dim: int = -1, algorithm: str = "auto") -> torch.Tensor:
    """``torch.softmax(x, dim)``; ``algorithm`` only chooses tilefuse's kernel and is ignored here."""
    return torch.softmax(x, dim)


def softmax_backward(y: torch.Tensor, dy: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """dx = y * (dy - sum(dy * y)) over ``dim``: the gradient of softmax given its output y."""
    return y * (dy - (dy * y).sum(dim, keepdim=True))
