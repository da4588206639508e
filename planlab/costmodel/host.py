"""The host side of offloading: copies between a device and host memory over the host link, and
the optimizer step on the host CPU, priced from the node's ``host`` spec
(:class:`~planlab.costmodel.hardware.HostSpec`).

A copy moves its bytes at the link's effective bandwidth, shared by the devices behind one link
(``devices_per_link``, a PCIe switch's uplink): the devices of a data-parallel update copy at the
same time, so each gets its share. Adam on the host steps ``params`` at the rate of the CPU cores
of this device's share of the node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planlab.costmodel.hardware import ClusterSpec, HostSpec
from planlab.errors import ConfigError

if TYPE_CHECKING:  # the Program's task type; costmodel does not import plan at run time
    from planlab.plan.program import Task

# Task roles (planlab.plan.program.Role values) that run on the host link or the host CPU
COPY_ROLES = frozenset({"to-host", "to-device", "save-to-host", "save-to-device"})
# Copies of saved activations, on a copy stream of their own while the device computes
SAVE_COPY_ROLES = frozenset({"save-to-host", "save-to-device"})
STEP_ROLES = frozenset({"host-step"})


def host_of(cluster: ClusterSpec) -> HostSpec:
    """The cluster's host spec; ConfigError when its spec gives none (offloading needs one)."""
    host = cluster.node.host
    if host is None:
        raise ConfigError(
            f"cluster {cluster.node.name!r} gives no host side (its spec has no 'host' object with the host "
            "link, host memory and CPU); offloading needs one: choose a GPU cluster or add it to the spec"
        )
    return host


def copy_time_s(host: HostSpec, nbytes: float) -> float:
    """Seconds to move ``nbytes`` between one device and host memory, on its share of the link."""
    return nbytes * host.devices_per_link / host.link_bytes_per_s


def host_task_time_s(cluster: ClusterSpec, task: Task) -> float | None:
    """Seconds for a task that runs on the host link or CPU (a copy to or from the host, a host
    optimizer step); None for any other task."""
    role = task.role.value
    if role in COPY_ROLES:
        return copy_time_s(host_of(cluster), task.nbytes)
    if role in STEP_ROLES:
        return task.params / host_of(cluster).adam_params_per_s
    return None
