"""Paged KV cache kernels: the append of new tokens into their pages and split-KV decode attention over pages."""
