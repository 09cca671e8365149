from dynatrain.models.configs import MODEL_CONFIGS, ModelConfig, get_model_config

__all__ = ["MODEL_CONFIGS", "ModelConfig", "get_model_config"]
