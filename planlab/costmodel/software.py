"""The software that drives a cluster's devices, as data: how operators become kernels and what
the host pays to issue them.

A cluster spec's optional ``software`` object selects the kernel-level cost model
(:mod:`planlab.costmodel.kernels`): each compute task is priced as the kernels its operator
launches in that implementation (GEMMs by tile and wave quantization, the rest by the memory
traffic they cause), and the host's time to issue them (eager PyTorch dispatches every
operator from Python, and launches every kernel from the CPU) is a floor that the device
cannot beat when its kernels are short. Fields (units in the names):

``implementation``
    ``"megatron"`` (Megatron-LM / Megatron-DeepSpeed's layers: unfused attention through a
    fused scale-mask-softmax, vocabulary-parallel cross entropy in fp32, apex layer norm,
    separately accumulated gradients) or ``"torch"`` (plain PyTorch modules: fused
    scaled-dot-product attention, ``F.cross_entropy``).
``host_call_us``, ``host_backward_call_us``
    the host's time per framework call in the forward (Python, dispatcher, autograd
    recording) and per autograd node in the backward, without the kernel launch;
``host_launch_us``
    the host's time to launch one kernel (``cudaLaunchKernel`` and the caching allocator);
``host_collective_us``
    the host's time to issue one collective (the library's enqueue);
``optimizer_bytes_per_param``
    memory traffic of one optimizer step per parameter (every pass of the mixed-precision
    optimizer over its gradients, master weights and moments).
"""

from __future__ import annotations

from dataclasses import dataclass

from planlab.errors import choices

IMPLEMENTATIONS = ("megatron", "torch")
_US = 1e-6
FIELDS = {
    "implementation",
    "host_call_us",
    "host_backward_call_us",
    "host_launch_us",
    "host_collective_us",
    "optimizer_bytes_per_param",
    "source",
    "description",
}


@dataclass(frozen=True)
class SoftwareSpec:
    """The training software's kernels and host costs (SI units)."""

    implementation: str = "torch"
    host_call_s: float = 0.0
    host_backward_call_s: float = 0.0
    host_launch_s: float = 0.0
    host_collective_s: float = 0.0
    optimizer_bytes_per_param: float = 16.0

    def __str__(self) -> str:
        return (
            f"{self.implementation} (host {self.host_call_s * 1e6:g}/{self.host_backward_call_s * 1e6:g} us per "
            f"call, {self.host_launch_s * 1e6:g} us per launch)"
        )


def software_from(f) -> SoftwareSpec:
    """Parse a spec's ``software`` object (``f`` is the hardware module's field reader)."""
    f.only(FIELDS)
    impl = f.text("implementation")
    if impl not in IMPLEMENTATIONS:
        raise f.error("implementation", f"is {impl!r}; choose {choices(IMPLEMENTATIONS)}")

    def us(key: str) -> float:
        return f.unit(key, "us", strict=False) * _US if key in f.obj else 0.0

    return SoftwareSpec(
        implementation=impl,
        host_call_s=us("host_call_us"),
        host_backward_call_s=us("host_backward_call_us"),
        host_launch_s=us("host_launch_us"),
        host_collective_s=us("host_collective_us"),
        optimizer_bytes_per_param=f.number(
            "optimizer_bytes_per_param", high=1000.0, unit="bytes moved per parameter per step"
        )
        if "optimizer_bytes_per_param" in f.obj
        else 16.0,
    )
