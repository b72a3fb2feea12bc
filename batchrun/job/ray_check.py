"""Whether Ray can be used, checked before anything heavy loads: `--ray` without the ray package fails
at once, naming the extra, without importing torch or the runner (job/ray_runner.py)."""
from __future__ import annotations

INSTALL_HINT = "pip install 'batchrun[ray]'"


class RayUnavailable(RuntimeError):
    """`--ray` / runtime.backend: ray without Ray installed, or no cluster at the given address."""


def require_ray():
    """Import ray or raise RayUnavailable naming the extra to install."""
    try:
        import ray
    except ImportError as e:
        raise RayUnavailable(f"running on Ray needs the ray package, which is not installed ({e}); "
                             f"install it with: {INSTALL_HINT}") from None
    return ray
