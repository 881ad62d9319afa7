"""Lightning data modules: CT cache, DICOM folders, feature files, in-memory bag arrays."""
from lightning_modules.data.bag_array_datamodule import BagArrayDataModule
from lightning_modules.data.ct_cache_datamodule import CTCacheDataModule
from lightning_modules.data.dicom_datamodule import DicomDataModule
from lightning_modules.data.feature_datamodule import FeatureDataModule

__all__ = ["BagArrayDataModule", "CTCacheDataModule", "DicomDataModule", "FeatureDataModule"]
