"""`backends.sim`: a CPU stand-in for an SGLang server (same HTTP API, radix cache, scheduler
and a timing model calibrated to real GPUs). Imports nothing of the proxy."""

from backends.sim.config import SimConfig
from backends.sim.profiles import PROFILES, Profile, get_profile
from backends.sim.server import SimServer

__all__ = ["PROFILES", "Profile", "SimConfig", "SimServer", "get_profile"]
