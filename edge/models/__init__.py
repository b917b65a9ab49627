"""Many models behind one edge: pools by model name, aliases, hardware groups, and gray release
(canary split, shadow diff-testing, drift detection, the ramp); the reference is docs/models.md."""

from edge.models.catalog import DEFAULT_MODEL, ModelCatalog
from edge.models.config import ModelsConfig
from edge.models.pools import ModelPools, Route
from edge.models.service import Models

__all__ = ["DEFAULT_MODEL", "ModelCatalog", "ModelPools", "Models", "ModelsConfig", "Route"]
