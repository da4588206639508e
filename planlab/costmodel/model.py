"""The cost model the simulator and the searches query: one cluster and its training software,
three prices, and an optional calibration profile that replaces the specs' numbers where it has
measurements.

The software (:mod:`planlab.costmodel.software`) and its precision are inputs beside the
cluster: ``CostModel.load(cluster, nodes, software="megatron", precision="bf16")``. Without
them the cluster's default applies: ``planlab`` (its own executor, fp32) on the ``cpu`` cluster,
``megatron`` on GPUs, in the device's default precision (fp16 on V100, bf16 elsewhere)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planlab.costmodel import comm, compute, ring
from planlab.costmodel.gemm import gemm_time_s
from planlab.costmodel.hardware import UNFUSED_ATTENTION, ClusterSpec, load_cluster
from planlab.costmodel.host import host_task_time_s
from planlab.costmodel.kernels import Kernel, op_kernels
from planlab.costmodel.precision import Precision
from planlab.costmodel.profile import Profile, load_profile
from planlab.costmodel.software import DEFAULT_SOFTWARE, SoftwareSpec, load_software
from planlab.errors import ConfigError, choices

if TYPE_CHECKING:  # the Program's task type; costmodel does not import plan at run time
    from planlab.plan.program import Task

# The ring's latency steps and traffic per rank, to carry a collective measured at one group
# size to another (comm._RING, by kind name; all_to_all moves (n-1)/n of the buffer in n-1 steps).
_SCALE = {c.value: f for c, f in comm._RING.items()}
_SCALE["all_to_all"] = (lambda n: n - 1, lambda n: (n - 1) / n)
# the collectives each kind of software's collective_buffers adds copies to (software.py)
_COPIED_KINDS = {"per_rank": ("all_gather", "reduce_scatter"), "copied": ("all_gather", "reduce_scatter")}
_ELEM_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}  # bytes per activation element by compute dtype


@dataclass(frozen=True)
class CostModel:
    """Prices compute, collectives and point-to-point transfers on ``cluster`` (seconds).

    With a ``profile`` (from ``planlab calibrate``), measured kernels, task overheads and
    collective fits take precedence over the spec's roofline and link models.
    """

    cluster: ClusterSpec
    profile: Profile | None = None
    software: SoftwareSpec | None = None  # None: the cluster's default (default_software)
    precision: Precision | None = None  # None: the device's default precision in that software

    def __post_init__(self) -> None:
        if self.software is None:
            object.__setattr__(self, "software", load_software(default_software(self.cluster)))
        if self.precision is None:
            object.__setattr__(self, "precision", precision_of(self.software, self.cluster, None))
        if self.profile is not None and self.profile.device != self.cluster.device.name:
            where = f" ({self.profile.path})" if self.profile.path else ""
            raise ConfigError(
                f"the profile{where} calibrates device {self.profile.device!r}; cluster "
                f"{self.cluster.node.name!r} has {self.cluster.device.name!r}. Calibrate on that "
                f"cluster or choose the cluster the profile was made on"
            )

    @classmethod
    def load(
        cls,
        name_or_path: str | os.PathLike[str],
        nodes: int = 1,
        profile: str | os.PathLike[str] | Profile | None = None,
        software: str | os.PathLike[str] | SoftwareSpec | None = None,
        precision: str | None = None,
    ) -> CostModel:
        """The cost model of a built-in cluster name or a spec file path (see ``load_cluster``),
        with a profile (a path or a Profile) if given, the training ``software`` (a built-in name,
        a path to a software file or a SoftwareSpec; None: the cluster's default) and its
        ``precision`` (None: the device's default)."""
        prof = load_profile(profile) if isinstance(profile, (str, os.PathLike)) else profile
        cluster = load_cluster(name_or_path, nodes)
        sw = software if isinstance(software, SoftwareSpec) else load_software(software or default_software(cluster))
        return cls(cluster, prof, sw, precision_of(sw, cluster, precision))

    @property
    def device_memory_bytes(self) -> float:
        """Memory one device has for planlab's tensors, in bytes: the capacity the driver reports
        less what the software takes first (CUDA context, NCCL buffers, workspaces) and the share
        its caching allocator loses to fragmentation."""
        return self.software.memory.usable_bytes(self.cluster.device.memory_bytes)

    @property
    def overlap_slowdown(self) -> float:
        """How much longer computation takes while an overlapped collective runs beside it: the
        device's SMs over those the collective leaves (``collective_sms`` of the node; a GEMM's
        waves spread over fewer SMs). 1.0 when the node states no ``collective_sms``."""
        node = self.cluster.node
        if not node.collective_sms or node.device.gemm is None:
            return 1.0
        sms = node.device.gemm.sm_count
        return sms / (sms - node.collective_sms)

    @property
    def dispatch_slowdown(self) -> float:
        """How much longer computation takes beside the expert dispatch or combine of the other action of
        a forward/backward pair: the device's SMs over those the dispatch kernels leave (the software's
        ``expert_dispatch_sms``); :attr:`overlap_slowdown` where the software states none."""
        gemm, taken = self.cluster.node.device.gemm, self.software.expert_dispatch_sms
        if not taken or gemm is None:
            return self.overlap_slowdown
        if taken >= gemm.sm_count:
            raise ConfigError(
                f"software {self.software.name!r}: expert_dispatch_sms={taken} leaves none of the device's "
                f"{gemm.sm_count} SMs to compute; expected fewer"
            )
        return gemm.sm_count / (gemm.sm_count - taken)

    @property
    def kernel_level(self) -> bool:
        """True when compute is priced kernel by kernel (the device gives its SMs and GEMM
        efficiency, and no profile replaces the spec)."""
        return self.cluster.device.gemm is not None and self.profile is None

    def describe_software(self) -> str:
        """One line: the software, its precision and how compute is priced."""
        sw, dev = self.software, self.cluster.device
        how = (
            f"kernel by kernel ({sw.implementation} kernels, GEMM tiles on {dev.gemm.sm_count} SMs)"
            if self.kernel_level
            else "calibration profile"
            if self.profile is not None
            else f"roofline (device {dev.name} gives no SM count)"
        )
        return (
            f"software {sw.name} ({self.precision.name}), compute priced {how}, "
            f"{self.device_memory_bytes / 2**30:.1f} GiB usable of {dev.memory_bytes / 2**30:.1f} GiB ({sw.memory})"
        )

    def compute_time_s(self, *, flops: float, bytes_moved: float, dtype: str) -> float:
        """Seconds for one compute task on one device (see ``compute.compute_time_s``). With a
        profile: the profiled kernel time plus the mean cost per forward/backward task."""
        if self.profile is not None:
            t = self._kernel_s(flops, bytes_moved, dtype, None)
            if t is not None:
                return (t + self.profile.compute_overhead_s) * self._slowdown
        return compute.compute_time_s(self.cluster.device, flops=flops, bytes_moved=bytes_moved, dtype=dtype)

    def _kernel_s(
        self, flops: float, bytes_moved: float, dtype: str, phase: str | None, kind: str = ""
    ) -> float | None:
        if flops < 0 or bytes_moved < 0:
            raise ConfigError(f"work must be >= 0, got flops={flops!r}, bytes_moved={bytes_moved!r}")
        if flops == 0 and bytes_moved == 0:
            return 0.0
        return self.profile.kernel_time_s(flops, bytes_moved, compute.canonical_dtype(dtype), phase, kind)

    def task_time_s(self, task: Task, dtype: str) -> float:
        """Seconds for one task of a Program on its stream, from everything the task says (its
        kind, work, tensors and group). Sends and receives cost 0 here: ``p2p_time_s`` prices
        the transfer, which needs the sending device.

        Without a profile this is the spec's price: compute tasks by ``compute_time_s`` (no work,
        no time), local copies as memory traffic, collectives by ``collective_time_s``. With a
        profile, every compute and copy task also pays the executor's measured cost per task of
        its kind, a task with no work (a view) the measured time of one, and the optimizer step
        its fitted fixed, per-tensor and per-parameter costs; all of them times the profile's
        slowdown for as many busy processes as the cluster has devices.
        """
        kind = task.kind.value
        if task.in_kernel:  # inside another task's kernel (a fused token permutation)
            return 0.0
        if kind == "C":
            return self.collective_time_s(task.collective, task.nbytes, tuple(task.group), task.node_share)
        if task.ring is not None:
            return self.ring_attention_s(task, dtype)[0]
        if kind == "F" and task.group:  # a piece that agrees with its group inside its forward
            return self._own_time_s(task, dtype) + self.agreement_time_s(task)
        return self._own_time_s(task, dtype)

    def ring_attention_s(self, task: Task, dtype: str) -> tuple[float, float]:
        """(device, host) seconds of a ring attention piece's forward or backward
        (:mod:`planlab.costmodel.ring`): its ``steps`` blocks, each priced as this model prices the
        attention on the piece's shapes (one chunk's queries against one chunk's keys), overlapped
        with the key/value block's transfer to the ring's slowest neighbour (intra- or inter-node,
        rail-aware: ``p2p_time_s``), or, for an all-gather ring, after the keys' and values' all-gather
        and (backward) before their gradients' reduce-scatter; the host issues every block."""
        n = task.ring.steps
        # a full block: the ring's shares price the causal mask's diagonal and skipped blocks
        block = task.but(ring=None, group=(), causal=False, flops=task.flops / n, bytes_moved=task.bytes_moved / n)
        block_s, host_s = (
            self.device_and_host_s(block, dtype) if self.host_bound else (self._own_time_s(block, dtype), 0.0)
        )
        eb = _ELEM_BYTES.get(compute.canonical_dtype(dtype), 4)
        kv_bytes = eb * sum(math.prod(s) for s in task.shapes[1:3]) if len(task.shapes) >= 3 else 0.0
        g, backward = task.group, task.kind.value != "F"
        if task.ring.gather:  # Llama 3's all-gather of the keys and values, exposed
            gather_s = self.collective_time_s("all_gather", n * kv_bytes, tuple(g))
            scatter_s = self.collective_time_s("reduce_scatter", n * kv_bytes, tuple(g)) if backward else 0.0
            return ring.gather_time_s(task.ring, backward, block_s, gather_s, scatter_s), n * host_s
        transfer_s = max((self.p2p_time_s(kv_bytes, g[i], g[(i + 1) % n]) for i in range(n)), default=0.0)
        return ring.ring_time_s(task.ring, backward, block_s, transfer_s), n * host_s

    def agreement_time_s(self, task: Task) -> float:
        """The collectives inside the forward of a piece whose task names a group
        (``planlab.plan.passes.forward.IN_OP_GROUPS``): for a vocabulary-parallel loss over N tokens,
        an all-reduce of N fp32 maxima, then one of 2N fp32 sums (Megatron-LM's
        vocab_parallel_cross_entropy)."""
        tokens = math.prod(task.shapes[0][:-1]) if task.shapes and task.shapes[0] else 1
        group = tuple(task.group)
        return self.collective_time_s("all_reduce", 4 * tokens, group) + self.collective_time_s(
            "all_reduce", 8 * tokens, group
        )

    def _own_time_s(self, task: Task, dtype: str) -> float:
        kind = task.kind.value
        if kind in ("S", "R"):
            return 0.0
        on_host = host_task_time_s(self.cluster, task)
        if on_host is not None:
            return on_host
        if self.host_bound:
            return max(self.device_and_host_s(task, dtype))
        nbytes = float(sum(s for _, s in task.alloc)) if kind == "L" else 0.0
        if self.profile is None:
            if kind == "L":
                return self.compute_time_s(flops=0.0, bytes_moved=2.0 * nbytes, dtype=dtype) if nbytes else 0.0
            if task.flops == 0 and task.bytes_moved == 0:
                return 0.0
            return self.compute_time_s(flops=task.flops, bytes_moved=task.bytes_moved, dtype=dtype)
        prof, slow = self.profile, self._slowdown
        if kind == "O" and prof.optimizer is not None:
            return prof.optimizer.time_s(max(1, len(task.writes)), task.params) * slow
        if kind == "L":
            t = self._kernel_s(0.0, 2.0 * nbytes, dtype, "F")
        elif task.flops == 0 and task.bytes_moved == 0 and prof.view_s(kind) is not None:
            return prof.view_s(kind) * slow  # a view: the executor's whole cost of a task with no kernel
        else:
            t = self._kernel_s(task.flops, task.bytes_moved, dtype, kind if kind in ("F", "B") else None, task.op_kind)
        if t is None:  # the profile has no kernel model for this dtype: the spec's roofline
            t = (
                compute.compute_time_s(self.cluster.device, flops=task.flops, bytes_moved=task.bytes_moved, dtype=dtype)
                if (task.flops or task.bytes_moved)
                else 0.0
            )
        return (t + prof.overhead_s(kind)) * slow

    @property
    def host_bound(self) -> bool:
        """True when compute is priced kernel by kernel (:attr:`kernel_level`): the software's
        host issue time is priced apart from the device's (``device_and_host_s``) and the
        simulator lets the host bound the device."""
        return self.kernel_level

    def device_and_host_s(self, task: Task, dtype: str) -> tuple[float, float]:
        """The device's time for ``task`` and the host's time to issue it, in seconds, by the
        kernel-level model of the ``software`` (see :mod:`planlab.costmodel.kernels`).
        The device cannot start a task's kernels before the host has issued them: consecutive
        tasks combine with :func:`host_bound_elapsed_s`. Off the kernel level (a device without
        GEMM data, or a profile, which measured whole tasks) the host costs nothing here."""
        sw = self.software
        kind = task.kind.value
        if task.in_kernel:  # inside another task's kernel (a fused token permutation): nothing to issue
            return 0.0, 0.0
        on_host = host_task_time_s(self.cluster, task)
        if not self.host_bound or on_host is not None:
            return (self.task_time_s(task, dtype) if on_host is None else on_host), 0.0
        if task.ring is not None:
            return self.ring_attention_s(task, dtype)
        dev = self.cluster.device
        if kind == "C":
            copies = sw.grad_reduce_copies if task.role == "bucket" else 0  # Role.BUCKET: a gradient bucket
            host_s = (
                sw.host_collective_s
                + (self.buffer_copies(task.collective, len(task.group)) + copies) * sw.host_launch_s
            )
            device_s = self.collective_time_s(task.collective, task.nbytes, tuple(task.group), task.node_share)
            return device_s + copies * self._pass_s(2.0 * task.nbytes), host_s
        if kind in ("S", "R"):
            return 0.0, sw.host_collective_s
        fp8 = compute.canonical_dtype(dtype) == "fp8"  # FP8 GEMMs, 16-bit everything else
        dtype = "bf16" if fp8 else dtype
        eb = _ELEM_BYTES.get(compute.canonical_dtype(dtype), 4)
        if kind == "L":
            nbytes = float(sum(s for _, s in task.alloc))
            if not nbytes:
                return 0.0, sw.host_call_s
            traffic = (3.0 if task.accumulate else 2.0) * nbytes
            return self._pass_s(traffic), sw.host_call_s + sw.host_launch_s
        if kind == "O":
            return self.optimizer_step_s(task)
        call_s = sw.host_call_s if kind == "F" else sw.host_backward_call_s
        if task.op_kind == "dropout" and task.flops == 0 and task.bytes_moved == 0:  # p = 0 returns its input
            return 0.0, call_s
        found = (
            op_kernels(
                task.op_kind,
                kind,
                task.shapes,
                eb,
                sw.implementation,
                fp8 and not task.output_layer,  # FP8 recipes keep the output projection in 16 bits
                sw.fused_softmax,
                sw.fused_attention,
                task.causal,
                sw.fused_rms_norm,
                task.fused_widths if sw.fuses(task.fusion) else (),
                task.weight_matmul and sw.fp8_weight_matmuls,
                weight_casts(task, sw),
                task.fp8_gathered,
                sw.fp8_block_scaling,
            )
            if task.op_kind and task.shapes and kind in ("F", "B")
            else None
        )
        if found is not None and kind == "B":  # zero-bubble's I or W task: its part of the kernels
            found = found.part(**gradient_parts(task))
        if found is None:  # a kind the kernel model does not know: one kernel by the roofline
            if task.flops == 0 and task.bytes_moved == 0:
                return 0.0, call_s
            return (
                compute.compute_time_s(dev, flops=task.flops, bytes_moved=task.bytes_moved, dtype=dtype),
                call_s + sw.host_launch_s,
            )
        device_s = sum(self.kernel_time_s(k, dtype) for k in found.kernels)
        return device_s, found.calls * call_s + len(found.kernels) * sw.host_launch_s

    def optimizer_step_s(self, task: Task) -> tuple[float, float]:
        """The device's and the host's time for an optimizer step (kernel level): its traffic per
        parameter (the precision's ``optimizer_pass_bytes``) at the achieved bandwidth; where the
        precision's ``per_tensor_overflow_check`` holds and the step is on whole weights (not a ZeRO
        shard), one check per weight tensor (``float(g.float().sum())`` in DeepSpeed's
        ``CheckOverflow``), each a host synchronization: the device idles while the host issues each
        next check's two kernels (a framework call and a launch each). The tensors are the software's:
        projections it fuses keep their weights in one tensor (``Task.merged_tensors``: Megatron's
        ``query_key_value`` for the query, key and value). Those gaps are the device's
        time only: the host issues the step's first kernels and then runs in step with the device,
        so charging them to the host as well would count them twice where the host is behind."""
        sw = self.software
        device_s = self._pass_s(task.params * self.precision.optimizer_pass_bytes)
        if self.precision.per_tensor_overflow_check and task.role == "":  # Role.PLAIN: the weights whole
            merged = sum(n for fusion, n in task.merged_tensors if sw.fuses(fusion))
            device_s += (len(task.writes) - merged) * 2 * (sw.host_call_s + sw.host_launch_s)
        return device_s, sw.host_call_s + sw.host_launch_s

    def kernel_time_s(self, kernel: Kernel, dtype: str) -> float:
        """Seconds one kernel takes on the device, its launch latency included: a GEMM by tile
        and wave quantization (:func:`planlab.costmodel.gemm.gemm_time_s`; a fused kernel that
        computes a share of its blocks, that share of the time), a pass by its bytes at the
        achieved memory bandwidth."""
        dev = self.cluster.device
        if kernel.gemm is None:
            return self._pass_s(kernel.bytes)
        b, m, n, k = kernel.gemm
        dtype = "fp8" if kernel.fp8 else dtype
        eb = _ELEM_BYTES.get(compute.canonical_dtype(dtype), 4)
        if dev.gemm is None:
            return compute.compute_time_s(
                dev,
                flops=2.0 * b * m * n * k * kernel.computed,
                bytes_moved=eb * b * (m * k + k * n + m * n),
                dtype=dtype,
            )
        hbm = dev.hbm_bytes_per_s * dev.memory_efficiency.max
        spec = dev.gemm
        if kernel.fp8:
            spec = spec.fp8_block() if kernel.block else spec.fp8()
        if kernel.core and spec.measured_attention(UNFUSED_ATTENTION):  # an unfused attention core's batched GEMM:
            # the tile model at the efficiency and tile overhead its kernel microbenchmark gives (devices.json)
            efficiency, overhead_k = spec.attention(UNFUSED_ATTENTION, kernel.backward)
            spec = dataclasses.replace(spec, tile_overhead_k=overhead_k, efficiency=efficiency)
        if kernel.fused:  # fused attention: the kernel's own efficiency and overhead per score element (in place
            # of a tiled GEMM's per-tile overhead, cuBLAS's), and its own memory traffic (no T x S output) as the floor
            chosen = self.software.attention_kernel(dev.architecture)  # the kernel the software runs on this device
            efficiency, overhead_k = spec.attention(chosen, kernel.backward)
            # (the kernel's measured efficiency already holds whatever the power limit took: no GEMM power ceiling)
            spec = dataclasses.replace(spec, tile_overhead_k=overhead_k, efficiency=efficiency, power_ceiling=0.0)
            peak = compute.peak_flops_per_s(dev, dtype)
            flop_s = gemm_time_s(
                spec, batch=b, m=m, n=n, k=k, elem_bytes=eb, peak_flops_per_s=peak, hbm_bytes_per_s=math.inf
            )
            return max(flop_s * kernel.computed, kernel.bytes / hbm) + dev.launch_overhead_s
        return (
            gemm_time_s(
                spec,
                batch=b,
                m=m,
                n=n,
                k=k,
                elem_bytes=eb,
                peak_flops_per_s=compute.peak_flops_per_s(dev, dtype),
                hbm_bytes_per_s=hbm,
            )
            * kernel.computed
            + dev.launch_overhead_s
        )

    def fill_s(self, nbytes: float) -> float:
        """A kernel writing ``nbytes`` once (``torch.zeros``): its traffic at the achieved bandwidth."""
        return self._pass_s(nbytes)

    def _pass_s(self, nbytes: float) -> float:
        """A memory-bound kernel moving ``nbytes``: its traffic at the achieved bandwidth for its size."""
        dev = self.cluster.device
        if nbytes <= 0:
            return dev.launch_overhead_s
        return nbytes / (dev.hbm_bytes_per_s * dev.memory_efficiency.at(nbytes)) + dev.launch_overhead_s

    @property
    def _slowdown(self) -> float:
        """The profile's factor on compute while every device of the cluster computes (a machine's
        processes share it; see ``Profile.slowdown_at``)."""
        return self.profile.slowdown_at(self.cluster.num_devices) if self.profile is not None else 1.0

    def collective_time_s(self, kind: str, nbytes: float, group: tuple[int, ...], node_share: float = 1.0) -> float:
        """Seconds for a collective on the full buffer of ``nbytes`` (see ``comm.collective_time_s``;
        ``node_share``: an all-to-all's share of its bytes for other nodes that crosses the network).
        With a profile that measured ``kind``: its fit at the group's size, or carried from the
        nearest measured size by the ring's steps and traffic."""
        base = comm.collective_time_s(self.cluster, kind, nbytes, group, node_share=node_share)  # validates all
        if self.profile is None or base == 0.0:
            if base == 0.0:
                return base
            return base + self.buffer_copies_s(kind, nbytes, len(group))
        found = self.profile.collective(kind, len(group))
        if found is None:
            return base
        fit, ranks = found
        n = len(group)
        if ranks == n:
            return fit.fit.time_s(nbytes)
        steps, traffic = _SCALE[kind]
        return fit.fit.alpha_s * steps(n) / steps(ranks) + nbytes / fit.fit.bytes_per_s * traffic(n) / traffic(ranks)

    def buffer_copies(self, kind: str, n: int) -> int:
        """How many copy kernels the software adds to a collective ``kind`` over ``n`` ranks
        (its ``collective_buffers``): ``per_rank``, one per rank of an all-gather or reduce-scatter
        (PyTorch's ProcessGroupNCCL copies each rank's part out of, or into, a flat buffer of its own); ``copied``, one
        per all-gather (its output copied into the parameters it holds) and per reduce-scatter
        (its input assembled from the gradients), as FSDP2 does; ``flat``, none."""
        if n < 2 or kind not in _COPIED_KINDS.get(self.software.collective_buffers, ()):
            return 0
        return n if self.software.collective_buffers == "per_rank" else 1

    def copy_out_s(self, task: Task) -> float:
        """The part of an all-gather's price (:meth:`buffer_copies_s`) that runs on the compute
        stream: FSDP2 (``collective_buffers`` ``copied``) copies the gathered buffer into the
        parameters with ``foreach_all_gather_copy_out`` on the current stream once it has waited for
        the gather (``FSDPParamGroup.wait_for_unshard``). 0.0 for other collectives and softwares,
        and with a profile (its fits price collectives without copies)."""
        if self.profile is not None or task.collective != "all_gather" or self.software.collective_buffers != "copied":
            return 0.0
        return self.buffer_copies_s(task.collective, task.nbytes, len(task.group))

    def buffer_copies_s(self, kind: str, nbytes: float, n: int) -> float:
        """The device's time for :meth:`buffer_copies` on a collective of ``nbytes`` (the full
        buffer): each copy reads and writes its share of the buffer."""
        copies = self.buffer_copies(kind, n)
        return copies * self._pass_s(2.0 * nbytes / copies) if copies else 0.0

    def p2p_time_s(self, nbytes: float, src: int, dst: int) -> float:
        """Seconds to send ``nbytes`` from ``src`` to ``dst`` (see ``comm.p2p_time_s``); with a
        profile that measured transfers, its fit."""
        base = comm.p2p_time_s(self.cluster, nbytes, src, dst)
        if self.profile is None or base == 0.0:
            return base
        found = self.profile.collective("p2p", 2)
        return found[0].fit.time_s(nbytes) if found is not None else base

    def __str__(self) -> str:
        prof = f", {self.profile}" if self.profile is not None else ""
        return f"CostModel({self.cluster}, {self.software} {self.precision}{prof})"


def default_software(cluster: ClusterSpec) -> str:
    """The software a cluster's plans run with unless told otherwise: planlab's own executor on
    CPU devices (the ``cpu`` cluster), Megatron-LM on GPUs."""
    return "planlab" if cluster.device.name == "cpu" else DEFAULT_SOFTWARE


def precision_of(software: SoftwareSpec, cluster: ClusterSpec, name: str | None) -> Precision:
    """The precision ``name`` of ``software`` (None: the device's default), checked against what
    the device computes: ConfigError for a precision the software lacks or the device has no
    peak for (FP8 on an A100)."""
    name = name or cluster.device.default_precision
    prec = software.precision(name)
    peaks = cluster.device.peak_flops_per_s
    if prec.compute_dtype not in peaks:
        have = [p for p in software.precisions if software.precisions[p].compute_dtype in peaks]
        raise ConfigError(
            f"device {cluster.device.name!r} has no {prec.compute_dtype} peak for precision {name!r}; choose {choices(have)}"
        )
    return prec


def weight_casts(task: Task, software: SoftwareSpec) -> float:
    """The share of its weight's FP8 cast a forward ``task`` makes: every forward casts it, unless the
    software keeps the cast across a step's micro-batches (``fp8_weight_cache``), which charges each
    forward ``1 / task.step_microbatches`` of the one cast a step and a recomputed forward nothing."""
    if not software.fp8_weight_cache:
        return 1.0
    return 0.0 if task.recompute == "redo" else 1.0 / task.step_microbatches  # Recompute.REDO


def gradient_parts(task: Task) -> dict[str, bool]:
    """Which gradients a backward task computes, from the kinds of the buffers it writes: ``inputs``
    (of activations) and ``weights`` (weight gradients). Zero-bubble's split writes None in place
    of the other part's buffers (:func:`planlab.plan.backward_split.split_task`)."""
    from planlab.plan.buffer import WEIGHT_GRAD_KINDS

    weights = any(w.kind in WEIGHT_GRAD_KINDS for w in task.writes if w)
    inputs = any(w.kind not in WEIGHT_GRAD_KINDS for w in task.writes if w)
    return {"inputs": inputs or not weights, "weights": weights}


def host_bound_elapsed_s(device_s: list[float], host_s: list[float]) -> list[float]:
    """Elapsed seconds of each task of a sequence that one host issues to one device stream in
    order: task ``i`` starts when the device has finished task ``i-1`` and the host has issued
    task ``i`` (the host runs ahead of the device, never behind it). Returns how far each task
    moves the device's clock; their sum is the sequence's time, at least the device's total
    and at least the host's. Host and device start together (a synchronising step before)."""
    out = []
    host_at = device_at = 0.0
    for d, h in zip(device_s, host_s):
        host_at += h
        end = max(device_at, host_at) + d
        out.append(end - device_at)
        device_at = end
    return out
