"""securetrain.masking.dicom"""
