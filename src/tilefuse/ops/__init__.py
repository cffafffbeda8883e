"""Public ops: argument checks, dispatch to a kernel launcher or the reference, autograd wiring."""
