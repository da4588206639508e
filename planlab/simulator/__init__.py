"""The simpy simulator: runs a Program against a CostModel."""

from planlab.simulator.classes import device_classes
from planlab.simulator.dryrun import find_deadlock
from planlab.simulator.engine import simulate
from planlab.simulator.result import DeviceStats, Event, SimResult, write_chrome_trace

__all__ = ["DeviceStats", "Event", "SimResult", "device_classes", "find_deadlock", "simulate", "write_chrome_trace"]
