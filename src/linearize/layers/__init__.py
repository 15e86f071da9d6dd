"""nn.Modules built on the ops: feature maps, gates, sinks (and, later, the hybrid attention)."""

from .feature_maps import FEATURE_MAPS, HedgehogFeatureMap, T2RFeatureMap
from .gates import GATES, GLAGate, Mamba2Gate, PoolGate, SigmoidGate
from .sinks import Sinks

__all__ = ["FEATURE_MAPS", "GATES", "GLAGate", "HedgehogFeatureMap", "Mamba2Gate", "PoolGate",
           "SigmoidGate", "Sinks", "T2RFeatureMap"]
