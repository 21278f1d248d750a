"""The run configuration: one small pydantic model per TOML section, loaded, overridden and frozen.

A config is validated completely before any worker starts (load.py: every mistake one line naming the
file or `--set`, the key, the value and what is allowed). One module per group of sections:
data.py ([data]), training.py ([train], [precision], [checkpoint], [metrics]), parallel.py
([parallel] the layout, [sync], [ps], [balance], [comm]), root.py (Config: every section and the checks
across them), auto.py (what a config leaves to the machine), reference.py (docs/config.md).
"""

from shoal.config.auto import auto_dtype, choose_dtype, resolve_auto
from shoal.config.base import Section, tomllib
from shoal.config.data import DataConfig, DataSource, data_kind
from shoal.config.load import MOVED, load_config, validate_config
from shoal.config.parallel import BalanceConfig, CommConfig, ParallelConfig, PSConfig, SyncConfig
from shoal.config.reference import config_reference
from shoal.config.root import LAYOUT_KEYS, LAYOUT_SECTIONS, SECTIONS, Config
from shoal.config.training import CheckpointConfig, MetricsConfig, PrecisionConfig, TrainConfig

__all__ = ["MOVED", "LAYOUT_KEYS", "LAYOUT_SECTIONS", "SECTIONS", "BalanceConfig", "CheckpointConfig", "CommConfig",
           "Config", "DataConfig", "DataSource", "MetricsConfig", "PSConfig", "ParallelConfig", "PrecisionConfig",
           "Section", "SyncConfig", "TrainConfig", "config_reference", "data_kind", "load_config", "tomllib",
           "validate_config", "auto_dtype", "choose_dtype", "resolve_auto"]
