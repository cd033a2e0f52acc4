"""The transformer (pure math) and its exact parameter and FLOP counts."""

from tenx.model.config import ModelConfig
from tenx.model.flops import count_params, flops_per_token
from tenx.model.transformer import Transformer, lm_loss

__all__ = ["ModelConfig", "Transformer", "count_params", "flops_per_token", "lm_loss"]
