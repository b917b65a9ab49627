"""Admission control: tenants and API keys, token buckets (memory or Redis), the queue-depth
throttle and the bounded priority queue. `Admission` is the stage `edge.app` calls."""

from edge.admission.settings import AdmissionSettings
from edge.admission.stage import Admission

__all__ = ["Admission", "AdmissionSettings"]
