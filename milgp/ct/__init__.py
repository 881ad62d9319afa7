"""The CT DICOM path: reading and checking DICOM series in Hounsfield units, indexing dataset layouts
(RSNA, CQ500, a folder per bag) into bags, the preprocessed per-bag cache (``milgp-cache``) and the
torch dataset of cached bags. It sits beside the GP library: nothing else under :mod:`milgp` imports it."""
