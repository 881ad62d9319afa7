"""Data: bags in memory, the CT DICOM path, datasets."""
