"""glm53: long-context decoding of GLM-5-family models in JAX, with the MLA history offloaded to host memory."""

from glm53.checkpoint import CheckpointError
from glm53.config import CacheConfig, ConfigError, ModelConfig
from glm53.engine import AdmissionError, Engine
from glm53.generate import GenerateResult, generate
from glm53.models import Model, from_config, from_pretrained, load
from glm53.session_io import SessionFileError
from glm53.sharding import MeshConfig
from glm53.tokenizer import Tokenizer

__all__ = ["AdmissionError", "CacheConfig", "CheckpointError", "ConfigError", "Engine", "GenerateResult", "MeshConfig",
           "Model", "ModelConfig", "SessionFileError", "Tokenizer", "from_config", "from_pretrained", "generate", "load"]
__version__ = "0.2.0"
