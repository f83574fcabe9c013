from fedexp.config.schema import RunConfig
from fedexp.config.schema import register_configs

__all__ = ["RunConfig", "register_configs"]
