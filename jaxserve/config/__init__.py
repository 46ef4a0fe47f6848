"""The configs of jaxserve: the model, the engine and one request's sampling.

Each is a frozen dataclass, validated once in `__post_init__`, and handed whole to its one owner:
`ModelConfig` to the model, `EngineConfig` to the engine, `SamplingParams` to a request.
"""

from __future__ import annotations

from jaxserve.config.checks import is_int, json_type, short
from jaxserve.config.constraint import Constraint, ConstraintKind
from jaxserve.config.engine import (
                                    AttentionBackend,
                                    CpuActivations,
                                    Dtype,
                                    EngineConfig,
                                    KVDtype,
                                    KVLayout,
                                    Platform,
                                    Quantization,
                                    QueuePolicy,
                                    SchedulerConfig,
                                    default_attention_backend,
                                    pick_quantization,
)
from jaxserve.config.lora import LoraConfig, LoRARequest
from jaxserve.config.model import LongRope, ModelConfig, ModelFamily, RopeScaling
from jaxserve.config.pooling import PoolingConfig, PoolingMode
from jaxserve.config.sampling import LogprobsMode, SamplingParams
from jaxserve.config.speculative import SpeculativeConfig

__all__ = ["AttentionBackend", "Constraint", "ConstraintKind", "CpuActivations", "Dtype",
           "EngineConfig", "KVDtype", "KVLayout", "LoRARequest", "LogprobsMode", "LoraConfig",
           "LongRope", "ModelConfig",
           "ModelFamily", "Platform", "PoolingConfig", "PoolingMode", "Quantization",
           "QueuePolicy", "RopeScaling",
           "SamplingParams", "SchedulerConfig", "SpeculativeConfig",
           "default_attention_backend", "is_int", "json_type", "pick_quantization", "short"]
