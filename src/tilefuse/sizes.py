"""Host-side integer helpers every launcher uses (plain Python: triton.cdiv and
triton.next_power_of_2 are constexpr functions whose every host call costs microseconds)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def m_bucket(m: int) -> int:
    """Autotune key for a size: the next power of two, so a new batch size rarely retunes."""
    return next_pow2(m) if m > 0 else 0
