"""DICOM de-identification per DICOM PS3.15 Annex E (Basic Profile + options).

Imports are lazy so ``securetrain --help`` never pays for pydicom or torch.
"""

from __future__ import annotations

from securetrain._lazy import lazy_exports


_EXPORTS = {
    "Deidentifier": "securetrain.masking.dicom.engine",
    "DeidReport": "securetrain.masking.dicom.engine",
    "TagChange": "securetrain.masking.dicom.engine",
    "read_dicom": "securetrain.masking.dicom.engine",
    "encode_dataset": "securetrain.masking.dicom.engine",
    "DeidKeys": "securetrain.masking.dicom.keys",
    "DicomPolicy": "securetrain.masking.dicom.policy",
    "load_policy": "securetrain.masking.dicom.policy",
    "Option": "securetrain.masking.dicom.profile_table",
    "load_table": "securetrain.masking.dicom.profile_table",
    "compile_profile": "securetrain.masking.dicom.profile_table",
    "export_mapping": "securetrain.masking.dicom.mapping",
    "load_mapping": "securetrain.masking.dicom.mapping",
    "DicomDataset": "securetrain.masking.dicom.dataset",
    "read_manifest": "securetrain.masking.dicom.dataset",
    "deidentify_tree": "securetrain.masking.dicom.tree",
    "TreeReport": "securetrain.masking.dicom.tree",
    "FileResult": "securetrain.masking.dicom.tree",
    "FileOutcome": "securetrain.masking.dicom.tree",
    "BatchWriter": "securetrain.masking.dicom.output",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
