"""What this CPU is, as benchmarks and the kernel-choice cache name it: model, the ISA flags that decide which
kernels can run (never which one is fastest: models/kernel_choice.py measures that), cores, last-level cache.
Linux reads /proc/cpuinfo and sysfs; elsewhere the fields are what platform tells."""
from __future__ import annotations

import functools
import os
import platform

# the extensions batchrun's kernels, oneDNN and llama.cpp pick paths by
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """{"model", "family" (x86's "family F model M": "AMD EPYC" names Zen 4 and Zen 5 alike; "" elsewhere),
    "flags" (those of ISA_FLAGS present), "cores" (this process may run on), "l3_bytes"}."""
    try:
        with open("/proc/cpuinfo") as f:
            info = parse_cpuinfo(f)
    except OSError:
        info = parse_cpuinfo([])
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return {**info, "cores": cores, "l3_bytes": _l3_bytes()}


def parse_cpuinfo(lines) -> dict:
    """{"model", "family", "flags"} from /proc/cpuinfo's lines (its first processor's block)."""
    model, flags, ids = platform.processor() or platform.machine(), set(), {}
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name":
            model = value.strip()
        elif key == "flags":
            flags = set(value.split())
        elif key in ("cpu family", "model"):
            ids[key] = value.strip()
        if flags and key == "":
            break
    family = f"family {ids['cpu family']} model {ids['model']}" if len(ids) == 2 else ""
    return {"model": model, "family": family, "flags": [f for f in ISA_FLAGS if f in flags]}


def _l3_bytes() -> int:
    """The largest cache's size from sysfs (32 MiB when it cannot be read: a common server L3)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for d in os.listdir(base):
            try:
                with open(os.path.join(base, d, "size")) as f:
                    s = f.read().strip()
            except OSError:
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
            best = max(best, int(s.rstrip("KMG") or 0) * mult)
    except OSError:
        pass
    return best or (32 << 20)


def machine_kind() -> str:
    """One line naming the CPU and the ISA level that matters here: "AMX", "AVX-512 BF16", "AVX2" or the
    architecture, e.g. "AMD EPYC family 26 model 2 (AVX-512 BF16, VNNI; 2 cores)"."""
    return kind_of(cpu_info())


def kind_of(info: dict) -> str:
    """machine_kind() for a cpu_info()-shaped dict."""
    f = set(info["flags"])
    level = ("AMX" if "amx_bf16" in f else "AVX-512 BF16" if "avx512_bf16" in f
             else "AVX2" if "avx2" in f else platform.machine())
    vnni = ", VNNI" if f & {"avx512_vnni", "avx_vnni"} else ""
    name = f"{info['model']} {info['family']}" if info["family"] else info["model"]
    return f"{name} ({level}{vnni}; {info['cores']} cores)"
