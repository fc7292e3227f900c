"""glm53: long-context decoding of GLM-5-family models in JAX, with the MLA history offloaded to host memory."""

from glm53.config import CacheConfig, ConfigError, ModelConfig
from glm53.engine import Model
from glm53.generate import GenerateResult, generate
from glm53.checkpoint import CheckpointError, from_config, from_pretrained, load
from glm53.tokenizer import Tokenizer

__all__ = ["CacheConfig", "ConfigError", "ModelConfig", "Model", "GenerateResult", "generate", "CheckpointError",
           "from_config", "from_pretrained", "load", "Tokenizer"]
__version__ = "0.1.0"
