"""DeepSeek-V4.1-Flash attention (CSA2): configs, layer kinds, CED prefill, bounded replay.

Importing this package registers the `csa_*` layer kinds in model.transformer.LAYER_KINDS,
so model.init_params / init_cache / forward run any DeepSeekConfig.
"""

from model.deepseek.config import (
           PRESETS,
           DeepSeekConfig,
           global_bytes_by_layer,
           layer_plan,
           preset,
)
from model.deepseek.layers import FROZEN_GLOBAL, KINDS

__all__ = ["FROZEN_GLOBAL", "KINDS", "PRESETS", "DeepSeekConfig", "global_bytes_by_layer", "layer_plan",
           "preset"]
