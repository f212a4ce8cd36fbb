"""``python -m optladder.optimizers.kernels``: build the CPU kernels ahead of time (the
bf16 kernel's library and the 8-bit kernel's) into the private cache, printing their
paths. Raises ``KernelBuildError`` (with the compiler's message) where a build fails."""

from __future__ import annotations

from optladder.optimizers.kernels import cpu, cpu8bit


def main() -> None:
    """Build both libraries (or verify the cached builds) and print their paths."""
    print(cpu.build())
    print(cpu8bit.build())


if __name__ == "__main__":
    main()
