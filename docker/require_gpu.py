"""The GPU image's start check: a node there trains on a GPU, or says in one sentence why not.

With train.device = auto, a torch that cannot use the driver would quietly train on the CPU of
a paid GPU instance. The entrypoint runs this before `join` or `train` in the GPU image unless
the device was chosen explicitly (LOWCOMM_DEVICE, or --set train.device=...). Exit 0 when torch
sees a GPU; otherwise one sentence on stderr (which driver is here, what to do) and exit 3.
"""

from __future__ import annotations

import ctypes
import sys

EXIT_NO_GPU = 3
# CUDA 13.x runs on drivers >= 580 (CUDA 12.x: >= 525): NVIDIA's minor-version compatibility.
MIN_DRIVER = {13: 580, 12: 525}


def driver_cuda_version() -> int | None:
    """The CUDA version the NVIDIA driver supports (e.g. 12080 for 12.8), or None with no driver.
    The driver's own library is what the NVIDIA container runtime mounts into the container."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value


def dotted(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def problem() -> str | None:
    """None when torch can use a GPU here, else the sentence that says why not and what to do."""
    import torch

    if torch.cuda.is_available():
        return None
    built = torch.version.cuda  # e.g. "13.0"; None for a CPU build
    cpu_ok = "or set LOWCOMM_DEVICE=cpu to train on the CPU on purpose"
    if built is None:
        return (f"this GPU image holds torch {torch.__version__}, a CPU-only build: build it "
                f"with --build-arg TORCH=cuda, {cpu_ok}")
    major = int(built.split(".")[0])
    need = f"NVIDIA driver >= {MIN_DRIVER.get(major, '?')}"
    driver = driver_cuda_version()
    if driver is None:
        return (f"no NVIDIA driver is visible in this container, so torch {torch.__version__} "
                f"(CUDA {built}) cannot use a GPU: run it with --gpus all (the NVIDIA container "
                f"toolkit) on a host with {need}, {cpu_ok}")
    if driver // 1000 < major:
        return (f"the NVIDIA driver here supports CUDA {dotted(driver)} but torch "
                f"{torch.__version__} is a CUDA {built} build: update the host to {need}, build "
                f"the image with a torch for CUDA {dotted(driver)} (docker/README.md), {cpu_ok}")
    return (f"the NVIDIA driver here supports CUDA {dotted(driver)}, yet torch "
            f"{torch.__version__} sees no GPU: give the container one (--gpus all, or a "
            f"Kubernetes nvidia.com/gpu limit), {cpu_ok}")


def main() -> int:
    sentence = problem()
    if sentence is None:
        return 0
    print(f"lowcomm-node: {sentence}.", file=sys.stderr)
    return EXIT_NO_GPU


if __name__ == "__main__":
    sys.exit(main())
