"""securetrain.masking.tabular"""
