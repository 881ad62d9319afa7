"""Lightning data modules: CT cache, feature files, in-memory bag arrays (all patient-split)."""
from lightning_modules.data.bag_array_datamodule import BagArrayDataModule
from lightning_modules.data.ct_cache_datamodule import CTCacheDataModule
from lightning_modules.data.feature_datamodule import FeatureDataModule
from lightning_modules.data.in_memory_dataset import InMemoryBagDataset

__all__ = ["BagArrayDataModule", "CTCacheDataModule", "FeatureDataModule", "InMemoryBagDataset"]
