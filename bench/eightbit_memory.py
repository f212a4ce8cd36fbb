"""Peak memory of an 8bit-rung step on the CPU: optladder's 8-bit kernel vs bitsandbytes.

For each engine, in this process (after a warm-up step on a small param, which loads the
kernel library and starts the threads): one float32 param of ``--elements`` elements and its
grad (filled in place, no temporaries), the optimizer, then two measured steps. Before
each step the resident set's high-water mark is reset (``echo 5 > /proc/self/clear_refs``,
Linux), and after it the extra peak is ``VmHWM - VmRSS`` as read before the step:

- step 1 creates the state, so its extra peak should be the state's bytes;
- step 2 should add nothing: the 8-bit kernel updates codes, absmax and param in place,
  while bitsandbytes' CPU fallback dequantizes both moments, the grad and the param to
  float32 (about +20 bytes per element).

Prints one line per engine and step; ``--json`` prints a JSON list instead (used by
tests/test_kernels_8bit_cpu.py at a small size).

    python bench/eightbit_memory.py                 # 16M elements
    python bench/eightbit_memory.py --elements 64M
"""

from __future__ import annotations

import argparse
import gc
import json
import re
from pathlib import Path
from typing import Any


def _status_bytes(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1)) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def measure(elements: int, engine: str) -> list[dict[str, Any]]:
    """Extra peak bytes of two steps of ``engine`` on one float32 param of ``elements``
    elements, with the state's bytes: ``"kernel"``, the 8bit rung (LadderAdamW's 8bit
    state format, stepped by optladder's 8-bit CPU kernel), or ``"bitsandbytes"``, plain
    ``bitsandbytes.optim.AdamW8bit`` (its per-tensor CPU update, the same state)."""
    import torch

    from optladder.optimizers.adamw import LadderAdamW

    def build(p: torch.nn.Parameter) -> torch.optim.Optimizer:
        if engine == "kernel":
            return LadderAdamW([{"params": [p], "rung": "8bit"}], lr=1e-3)
        if engine == "bitsandbytes":
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit([p], lr=1e-3)
        raise ValueError(f"engine must be 'kernel' or 'bitsandbytes', got {engine!r}")

    # Made once per process, before the measured steps: the kernel library, its worker
    # threads and the code books' shared encoder tables (cpu8bit.book_tables). The warm
    # optimizer stays alive so that its memory is not reused by the measured one.
    warm = torch.nn.Parameter(torch.zeros(1 << 20))
    warm.grad = torch.ones(1 << 20)
    warm_opt = build(warm)
    warm_opt.step()
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.empty(elements).normal_())
    p.grad = torch.empty(elements).normal_()
    opt = build(p)
    rows = []
    for step in (1, 2):
        gc.collect()
        before = _status_bytes("VmRSS")
        _reset_peak()
        opt.step()
        peak = _status_bytes("VmHWM")
        state = opt.state[p]
        state_bytes = sum(t.nbytes for t in state.values() if isinstance(t, torch.Tensor))
        rows.append(
            {
                "engine": engine,
                "elements": elements,
                "step": step,
                "extra_peak_bytes": peak - before,
                "state_bytes": state_bytes,
                "fallback": sorted(set(getattr(opt, "eager_reasons", {}).values())),
            }
        )
    del opt, p, warm_opt
    gc.collect()
    return rows


def _elements(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1:].upper() in units:
        return int(float(text[:-1]) * units[text[-1].upper()])
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=_elements, default=16 << 20, help="e.g. 16M")
    parser.add_argument(
        "--engines", default="kernel,bitsandbytes", help="comma-separated: kernel,bitsandbytes"
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    args = parser.parse_args()
    rows = []
    for engine in args.engines.split(","):
        rows += measure(args.elements, engine)
    if args.json:
        print(json.dumps(rows))
        return
    for row in rows:
        ratio = row["extra_peak_bytes"] / row["state_bytes"]
        print(
            f"{row['engine']:>12} step {row['step']}: extra peak "
            f"{row['extra_peak_bytes'] / 2**20:8.1f} MiB = {ratio:6.3f} x state "
            f"({row['state_bytes'] / 2**20:.1f} MiB, {row['elements']:,} elements)"
        )


if __name__ == "__main__":
    main()
