"""Model definitions, chosen from config.json `architectures` through a registry."""
from .registry import ARCHITECTURES, eos_token_ids, load_model, model_class, multiplies_natively, read_config

__all__ = ["ARCHITECTURES", "eos_token_ids", "load_model", "model_class", "multiplies_natively", "read_config"]
